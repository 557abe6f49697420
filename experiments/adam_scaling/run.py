#!/usr/bin/python3
"""AdamW on an elastic schedule of batch changes: which learning-rate rule
keeps training on track when the global batch moves (shape, not numbers)?

The GPT of examples/gpt (byte-level, 2 layers, width 128, context 64) on
Python source bytes, AdamW (lr tuned for one worker: elastic.reference_batch
= the per-worker batch), clipping at 1.0, in Limbo's elastic simulator
(`limbo sim --mode elastic`: the real trainer's step, policy and optimizer
with virtual workers) following --schedule (epoch:workers). Rules compared,
each over --seeds seeds:

  none    the rate stays as tuned for one worker (elastic.batch_policy=none);
  linear  the rate follows kappa = B / B_ref, ramped (dynamic, linear rule);
  sqrt    the square-root rule of Malladi et al. (2022): rate x sqrt(kappa),
          1 - beta1 and 1 - beta2 x kappa, eps / sqrt(kappa), ramped.

Writes results/README.md (held-out loss per rule and seed, median and
spread) and results/loss.png (training loss against samples).

    experiments/adam_scaling/run.py [--seeds 3] [--schedule 0:1,1:4,2:2] [--out DIR]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
RULES = {"none": ["elastic.batch_policy=none"],
         "linear": ["elastic.batch_policy=dynamic", "elastic.scaling=linear"],
         "sqrt": ["elastic.batch_policy=dynamic", "elastic.scaling=sqrt"]}


def run(limbo, data, out, rule, seed, a):
    d = os.path.join(out, "runs", f"{rule}-seed{seed}")
    if os.path.exists(os.path.join(d, "summary.json")):
        return d
    shutil.rmtree(d, ignore_errors=True)
    epochs = len(a.schedule.split(","))
    sets = ["model.name=torchscript", f"model.path={data}/gpt.pt", "data.dataset=tensors", f"data.path={data}",
            f"data.train_limit={a.train_limit}", f"data.batch_size={a.batch}", "optim.algorithm=adamw",
            f"optim.lr={a.lr}", "optim.weight_decay=0.01", "optim.clip_grad_norm=1.0", f"train.seed={seed}",
            f"train.epochs={epochs}", "train.threads=2", "train.log_every=25", "train.progress=false",
            f"elastic.reference_batch={a.batch}", f"elastic.ramp_iterations={a.ramp}", "sim.mode=elastic",
            f"sim.elastic_schedule={a.schedule}"] + RULES[rule]
    cmd = [limbo, "sim", "--run-dir", d]
    for s in sets:
        cmd += ["--set", s]
    print(f"[adam-scaling] {rule} seed {seed} ...", flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return d


def records(d):
    out = []
    for line in open(os.path.join(d, "metrics.jsonl")):
        r = json.loads(line)
        if r.get("kind") == "train":
            out.append(r)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--limbo", default=os.path.join(ROOT, "build/src/cli/limbo"))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--schedule", default="0:1,1:4,2:2")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--ramp", type=int, default=50)
    ap.add_argument("--train-limit", type=int, default=8000)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    a = ap.parse_args()
    data = os.path.join(a.out, "data")
    if not os.path.exists(os.path.join(data, "gpt.pt")):
        subprocess.run(["/usr/bin/python3", os.path.join(ROOT, "examples/gpt/prepare.py"), data, "--corpus", "python",
                        "--windows", "40000"], check=True)
    results = {}
    for seed in range(1, a.seeds + 1):
        for rule in RULES:  # interleaved: every rule once per seed
            d = run(a.limbo, data, a.out, rule, seed, a)
            results.setdefault(rule, []).append((seed, json.load(open(os.path.join(d, "summary.json"))), d))
    lines = ["# AdamW under batch changes: none vs linear vs square-root rule", "",
             f"GPT of examples/gpt, AdamW lr {a.lr} tuned for one worker of batch {a.batch}, clipping 1.0, "
             f"schedule {a.schedule} (epoch:workers) over {a.train_limit} windows an epoch, "
             f"ramp {a.ramp} iterations; `limbo sim --mode elastic`. Held-out loss in nats per byte "
             "(lower is better).", "",
             "| rule | " + " | ".join(f"seed {s}" for s in range(1, a.seeds + 1)) + " | median | spread |",
             "| --- | " + " | ".join("---" for _ in range(a.seeds)) + " | --- | --- |"]
    for rule, rs in results.items():
        losses = [s["test_loss"] for _, s, _ in rs]
        lines.append(f"| {rule} | " + " | ".join(f"{v:.4f}" for v in losses) +
                     f" | {statistics.median(losses):.4f} | {min(losses):.4f}–{max(losses):.4f} |")
    text = "\n".join(lines) + "\n"
    open(os.path.join(a.out, "README.md"), "w").write(text)
    print(text)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4))
        colors = {"none": "#888", "linear": "#c52", "sqrt": "#27c"}
        for rule, rs in results.items():
            for i, (_, _, d) in enumerate(rs):
                rec = records(d)
                ax.plot([r["samples"] for r in rec], [r["loss"] for r in rec], color=colors[rule], alpha=0.7,
                        label=rule if i == 0 else None)
        ax.set_xlabel("samples")
        ax.set_ylabel("training loss (nats/byte)")
        ax.set_title(f"AdamW, schedule {a.schedule}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(a.out, "loss.png"), dpi=110)
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)


if __name__ == "__main__":
    main()
