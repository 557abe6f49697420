#!/usr/bin/python3
"""AdamW on the parameter server under staleness: which rule holds against
synchronous AdamW? (fourth fault review, S1.)

The GPT of examples/gpt (byte-level, 2 layers, width 128, context 64) on the
King James Bible, AdamW at a constant rate (asynchronous mode has no
schedule), clipping at 1.0, bf16, one epoch. The parameter-server runs use
the simulator (`limbo sim`: the shard's own Aggregator and ShardState with
lambda virtual learners, gradients computed for real on the weights each
learner pulled), so every contender does the same compute:

  sync B             `limbo train`, one process, global batch B = lambda x b
  hardsync           lambda learners of batch b, one update a round (tau = 0)
  n-softsync, decay at update / base
                     an update every max(1, lambda / n) gradients, rate
                     alpha0 / tau; AdamW's decoupled decay at the update's
                     own rate (ps.weight_decay_rate = update, the default)
                     or at alpha0 in every update (= base, the rule before)
  n-softsync, inverse_sqrt / constant
                     the rate alpha0 / sqrt(tau), or alpha0 whatever tau
                     (ps.staleness), decay at the update's rate

Seeds are interleaved (every contender for seed 1, then seed 2, ...).
Writes results/README.md: held-out loss (nats/byte) per contender, median
and range over the seeds. Needs examples/gpt/setup.sh first.

    experiments/ps_adam/run.py [--seeds 2] [--learners 4] [--weight-decay 0.1]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def contenders(a):
    lam = a.learners
    c = {f"sync {lam * a.batch}": ("train", [f"data.batch_size={lam * a.batch}"]),
         "hardsync": ("sim", ['ps.protocol="hardsync"'])}
    for n in (lam // 2, lam):
        for rule in ("update", "base"):
            c[f"{n}-softsync, decay at {rule}"] = (
                "sim", ['ps.protocol="softsync"', f"ps.softsync_n={n}", f'ps.weight_decay_rate="{rule}"'])
        for policy in ("inverse_sqrt", "constant"):
            c[f"{n}-softsync, {policy}"] = (
                "sim", ['ps.protocol="softsync"', f"ps.softsync_n={n}", f'ps.staleness="{policy}"'])
    return c


def run(a, kind, extra, seed):
    d = tempfile.mkdtemp(prefix="limbo-ps-adam-")
    try:
        sets = ["model.name=torchscript", f'model.path="{a.data}/gpt.pt"', 'data.dataset="tokens"',
                f'data.path="{a.data}"', "data.context=64", f"data.batch_size={a.batch}", 'optim.algorithm="adamw"',
                f"optim.lr={a.lr}", f"optim.weight_decay={a.weight_decay}", "optim.clip_grad_norm=1.0",
                'optim.schedule="constant"', "train.epochs=1", 'train.precision="bf16"', f"train.seed={seed}",
                "train.threads=2", "train.progress=false", "train.eval_every_steps=0"]
        if kind == "sim":
            sets += [f"sim.learners={a.learners}", 'sim.compute="normal"', "sim.compute_cv=0.2"]
        cmd = [a.limbo, kind, "--run-dir", d]
        for s in sets + extra:
            cmd += ["--set", s]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(os.path.join(d, "summary.json")) as f:
            s = json.load(f)
        return s["test_loss"], s.get("staleness_mean")
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--learners", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.003)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--data", default=os.path.join(ROOT, "data", "gpt"))
    ap.add_argument("--limbo", default=os.path.join(ROOT, "build", "src", "cli", "limbo"))
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    a = ap.parse_args()
    a.limbo = os.path.abspath(a.limbo)
    a.data = os.path.abspath(a.data)
    runs = contenders(a)
    loss = {k: [] for k in runs}
    tau = {k: [] for k in runs}
    # Each finished run is kept in results/runs.json (an interrupted or
    # extended campaign goes on where it stopped; delete the file to redo).
    os.makedirs(a.out, exist_ok=True)
    cache_path = os.path.join(a.out, "runs.json")
    cache = json.load(open(cache_path)) if os.path.exists(cache_path) else {}
    for seed in range(1, a.seeds + 1):
        for name, (kind, extra) in runs.items():
            key = f"{name} | seed {seed} | lambda {a.learners} | wd {a.weight_decay} | lr {a.lr}"
            if key not in cache:
                t0 = time.time()
                l, t = run(a, kind, extra, seed)
                cache[key] = {"loss": l, "staleness_mean": t}
                with open(cache_path, "w") as f:
                    json.dump(cache, f, indent=1)
                print(f"seed {seed}  {name:32s} held-out loss {l:.4f}  ({time.time() - t0:.0f} s)", flush=True)
            loss[name].append(cache[key]["loss"])
            if cache[key]["staleness_mean"] is not None:
                tau[name].append(cache[key]["staleness_mean"])
    lines = ["| run | held-out loss, nats/byte (median) | range over seeds | mean staleness |",
             "| --- | --- | --- | --- |"]
    for name, v in loss.items():
        t = f"{statistics.mean(tau[name]):.2f}" if tau[name] else "–"
        lines.append(f"| {name} | {statistics.median(v):.4f} | {min(v):.4f}–{max(v):.4f} | {t} |")
    text = ("# AdamW on the parameter server under staleness\n\n" + "\n".join(lines) +
            f"\n\n{a.seeds} seeds; lambda = {a.learners} learners of batch {a.batch}; AdamW lr {a.lr} (constant), "
            f"weight decay {a.weight_decay}, clipping 1.0, bf16, one epoch; the inverse staleness rule (alpha0 / tau) and "
            "the decay at the update's rate unless the row names another; the simulator's compute times normal, "
            "cv 0.2.\n"
            f"Command: experiments/ps_adam/run.py --seeds {a.seeds} --learners {a.learners} "
            f"--weight-decay {a.weight_decay}\n")
    with open(os.path.join(a.out, "README.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
