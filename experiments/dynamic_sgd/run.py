#!/usr/bin/python3
"""Dynamic SGD on an elastic job: static vs linear vs dynamic learning-rate
policies while the worker count changes every epoch (Lin et al., shape only).

MLP on Fashion-MNIST, per-worker batch 32, SGD momentum 0.9, base lr tuned
for one worker (elastic.reference_batch = 32). Elastic runs follow
--elastic-schedule (default 1,4,2,4,1,2 workers over 6 epochs) with
`linear` (lr x R at once) or `dynamic` (ramp up over T iterations, drop at
once); the static run uses one worker with the schedule's mean global batch
and the matching linear rate. Real processes via `limbo launch`.

    experiments/dynamic_sgd/run.py [--seeds 3] [--lr 0.04] [--out experiments/dynamic_sgd/results]
    experiments/dynamic_sgd/run.py --sim   # virtual workers, 1x-16x (limbo sim)
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess


def common(run_dir, seed, lr, epochs, policy, batch):
    return ["--run-dir", run_dir, "--set", "model.name=mlp", "--set", f"data.batch_size={batch}",
            "--set", f"optim.lr={lr}", "--set", "optim.momentum=0.9", "--set", f"train.seed={seed}",
            "--set", f"train.epochs={epochs}", "--set", "train.progress=false",
            "--set", "train.log_every=20", "--set", "train.checkpoint_every_epochs=0",
            "--set", f"elastic.batch_policy={policy}", "--set", "elastic.reference_batch=32"]


def run(limbo, out, name, seed, args, schedule):
    d = os.path.join(out, "runs", f"{name}-seed{seed}")
    if os.path.exists(os.path.join(d, "summary.json")):
        return d
    shutil.rmtree(d, ignore_errors=True)
    counts = [int(x.split(":")[1]) for x in schedule.split(",")]
    epochs = len(counts)
    print(f"[dynamic-sgd experiment] {name} seed {seed} ...", flush=True)
    if name == "static":
        mean_batch = round(32 * statistics.mean(counts))
        cmd = [limbo, "train"] + common(d, seed, args.lr, epochs, "linear", mean_batch)
    elif args.sim:  # virtual workers: limbo sim's elastic mode, same policies
        cmd = [limbo, "sim", "--set", "sim.mode=elastic", "--set", f"sim.elastic_schedule={schedule}"]
        cmd += common(d, seed, args.lr, epochs, name, 32)
        cmd += ["--set", f"elastic.ramp_iterations={args.ramp}"]
    else:
        cmd = [limbo, "launch", "--nproc", str(counts[0]), "--elastic-schedule", schedule, "--"]
        cmd += common(d, seed, args.lr, epochs, name, 32)
        cmd += ["--set", f"elastic.ramp_iterations={args.ramp}"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return d


def load(d):
    train, evals = [], []
    for line in open(os.path.join(d, "metrics.jsonl")):
        r = json.loads(line)
        (train if r["kind"] == "train" else evals if r["kind"] == "eval" else []).append(r)
    return train, evals, json.load(open(os.path.join(d, "summary.json")))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limbo", default="build/src/cli/limbo")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--lr", type=float, default=0.04)
    ap.add_argument("--ramp", type=int, default=200)
    ap.add_argument("--schedule", default="0:1,1:4,2:2,3:4,4:1,5:2")
    ap.add_argument("--out", default="experiments/dynamic_sgd/results")
    ap.add_argument("--sim", action="store_true",
                    help="virtual workers (limbo sim); default schedule 1x-16x over 10 epochs, lr 0.01")
    args = ap.parse_args()
    if args.sim:
        given = {a.split("=")[0] for a in os.sys.argv[1:]}
        if "--schedule" not in given:
            args.schedule = "0:1,1:1,2:16,3:16,4:4,5:4,6:16,7:16,8:2,9:2"
        if "--lr" not in given:
            args.lr = 0.01
        if "--out" not in given:
            args.out = "experiments/dynamic_sgd/results-sim"
    os.makedirs(os.path.join(args.out, "runs"), exist_ok=True)
    names = ["static", "linear", "dynamic"]
    data = {}
    for seed in range(1, args.seeds + 1):
        for name in names:
            data[(name, seed)] = load(run(args.limbo, args.out, name, seed, args, args.schedule))
    seeds = range(1, args.seeds + 1)
    rows = []
    for name in names:
        acc = [100 * data[(name, s)][2]["test_accuracy"] for s in seeds]
        loss = [data[(name, s)][2].get("train_loss") for s in seeds]
        loss = [x if x is not None else float("nan") for x in loss]  # null = diverged (NaN)
        changes = [data[(name, s)][2].get("membership_changes", 0) for s in seeds]
        sd = statistics.stdev(acc) if len(acc) > 1 else 0.0
        rows.append(f"| {name} | {statistics.mean(acc):.2f} ± {sd:.2f} | "
                    f"{statistics.mean(loss):.4f} | {statistics.mean(changes):.1f} |")
    table = ("| policy | final test accuracy (%) | final train loss | membership changes |\n"
             "| --- | --- | --- | --- |\n" + "\n".join(rows) + "\n")
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write("# Dynamic SGD on an elastic job (MLP, Fashion-MNIST)" +
                (", simulated workers (limbo sim)" if args.sim else "") + "\n\n")
        f.write(f"Worker schedule {args.schedule} (epoch:workers), per-worker batch 32, "
                f"base lr {args.lr} for one worker, momentum 0.9, dynamic ramp "
                f"T = {args.ramp} iterations, {args.seeds} seeds; static = one worker at the "
                f"schedule's mean global batch with the matching linear rate.\n\n")
        f.write(table)
    print(table)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    colors = {"static": "tab:gray", "linear": "tab:blue", "dynamic": "tab:red"}
    for name in names:
        for s in seeds:
            train, evals, _ = data[(name, s)]
            lab = name if s == 1 else None
            axes[0].plot([e["epoch"] for e in evals], [100 * e["test_accuracy"] for e in evals],
                         color=colors[name], alpha=0.7, marker="o", ms=3, label=lab)
            axes[1].plot([t["epoch"] for t in train], [t["lr"] for t in train], color=colors[name],
                         alpha=0.7, label=lab)
            axes[2].plot([t["epoch"] for t in train], [t["batch_size"] / 32 for t in train],
                         color=colors[name], alpha=0.7, label=lab)
    axes[0].set_ylabel("test accuracy (%)")
    axes[1].set_ylabel("learning rate")
    axes[2].set_ylabel("workers (global batch / 32)")
    axes[2].set_xlabel("epoch")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "dynamic_sgd.png"), dpi=120)


if __name__ == "__main__":
    main()
