#!/usr/bin/python3
"""ISGD against SGD at equal settings: LeNet on Fashion-MNIST.

Both use Caffe's LeNet solver (batch 64, lr 0.01, momentum 0.9, weight decay
5e-4, `inv` schedule with gamma 1e-4 and power 0.75) and the same fixed-cycle
data order; ISGD runs with its documented defaults (k = 3, stop = 5,
epsilon = 0.1, zeta = lr), untuned. For each seed it records the training
time and epochs at which the test accuracy first reaches each target
(evaluated every quarter epoch), the final accuracy, and the training loss.

    experiments/isgd/run.py [--seeds 5] [--epochs 6] [--out experiments/isgd/results]

Writes <out>/README.md (table), <out>/isgd_loss.png, <out>/isgd_accuracy.png
and keeps every run directory under <out>/runs/.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

TARGETS = (0.88, 0.90)


def run(limbo, run_dir, algorithm, seed, epochs, threads):
    if os.path.exists(os.path.join(run_dir, "summary.json")):
        return  # already done (the experiment can be resumed)
    if os.path.exists(run_dir):
        subprocess.run(["rm", "-rf", run_dir], check=True)
    cmd = [limbo, "train", "--run-dir", run_dir,
           "--set", "model.name=lenet", "--set", "data.dataset=fashion-mnist",
           "--set", "data.batch_size=64", "--set", "data.order=fixed-cycle",
           "--set", "optim.lr=0.01", "--set", "optim.momentum=0.9",
           "--set", "optim.weight_decay=0.0005", "--set", "optim.schedule=inv",
           "--set", "optim.inv_gamma=0.0001", "--set", "optim.inv_power=0.75",
           "--set", f"optim.algorithm={algorithm}", "--set", f"train.seed={seed}",
           "--set", f"train.epochs={epochs}", "--set", "train.eval_every_steps=235",
           "--set", f"train.threads={threads}", "--set", "train.progress=false",
           "--set", "train.checkpoint_every_epochs=0"]
    print(f"[isgd experiment] {algorithm} seed {seed} ...", flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def load(run_dir):
    evals, train = [], []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if r["kind"] == "eval":
                evals.append(r)
            elif r["kind"] == "train":
                train.append(r)
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    return evals, train, summary


def first_reach(evals, target):
    for e in evals:
        if e["test_accuracy"] >= target:
            return e["train_seconds"], e["epoch"]
    return None, None


def fmt(values, digits=1):
    values = [v for v in values if v is not None]
    if not values:
        return "not reached"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limbo", default="build/src/cli/limbo")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="experiments/isgd/results")
    args = ap.parse_args()
    os.makedirs(os.path.join(args.out, "runs"), exist_ok=True)
    seeds = list(range(1, args.seeds + 1))
    data = {}
    for seed in seeds:  # interleaved, so machine drift hits both alike
        for alg in ("sgd", "isgd"):
            d = os.path.join(args.out, "runs", f"{alg}-seed{seed}")
            run(args.limbo, d, alg, seed, args.epochs, args.threads)
            data[(alg, seed)] = load(d)

    rows = []
    header = ["algorithm", "runs"]
    for t in TARGETS:
        header += [f"time to {t:.0%} (s)", f"epochs to {t:.0%}", f"reached {t:.0%}"]
    header += ["final accuracy (%)", "triggered batches", "extra iterations", "train time (s)"]
    for alg in ("sgd", "isgd"):
        row = [alg.upper(), str(len(seeds))]
        for t in TARGETS:
            reach = [first_reach(data[(alg, s)][0], t) for s in seeds]
            row += [fmt([r[0] for r in reach]), fmt([r[1] for r in reach], 2),
                    f"{sum(r[0] is not None for r in reach)}/{len(seeds)}"]
        summ = [data[(alg, s)][2] for s in seeds]
        row += [fmt([100 * s["test_accuracy"] for s in summ], 2),
                fmt([s.get("isgd_triggered_batches") for s in summ], 0) if alg == "isgd" else "—",
                fmt([s.get("isgd_extra_iterations") for s in summ], 0) if alg == "isgd" else "—",
                fmt([s["train_seconds"] for s in summ])]
        rows.append(row)
    table = "| " + " | ".join(header) + " |\n|" + " --- |" * len(header) + "\n"
    table += "".join("| " + " | ".join(r) + " |\n" for r in rows)

    overhead = [data[("isgd", s)][2].get("isgd_plain_step_seconds_mean") for s in seeds]
    sgd_step = [data[("sgd", s)][2]["train_seconds"] / data[("sgd", s)][2]["steps"] for s in seeds]
    ratio = statistics.mean(overhead) / statistics.mean(sgd_step) if all(overhead) else None

    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write("# ISGD vs SGD: LeNet on Fashion-MNIST\n\n")
        f.write(f"{len(seeds)} seeds each, {args.epochs} epochs, {args.threads} threads; "
                "time is training time (evaluation excluded), accuracy evaluated every "
                "quarter epoch on the 10k test split. Values are mean ± std over seeds "
                "that reached the target.\n\n")
        f.write(table)
        if ratio:
            f.write(f"\nMean time of an ISGD step that did not trigger / mean SGD step: "
                    f"{ratio:.3f}\n")
        f.write("\nPlots: isgd_loss.png (training loss), isgd_accuracy.png (test accuracy "
                "against training time).\n")
    print(table)
    if ratio:
        print(f"non-triggering ISGD step / SGD step: {ratio:.3f}")

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plots", file=sys.stderr)
        return
    colors = {"sgd": "tab:blue", "isgd": "tab:red"}
    fig, ax = plt.subplots(figsize=(7, 4))
    for alg in ("sgd", "isgd"):
        for i, s in enumerate(seeds):
            tr = data[(alg, s)][1]
            ax.plot([r["epoch"] for r in tr], [r["loss"] for r in tr], color=colors[alg],
                    alpha=0.5, lw=0.8, label=alg.upper() if i == 0 else None)
    ax.set_xlabel("epoch")
    ax.set_ylabel("training loss (mean over 50 steps)")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title("LeNet / Fashion-MNIST: training loss")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "isgd_loss.png"), dpi=120)
    fig, ax = plt.subplots(figsize=(7, 4))
    for alg in ("sgd", "isgd"):
        for i, s in enumerate(seeds):
            ev = data[(alg, s)][0]
            ax.plot([e["train_seconds"] for e in ev], [100 * e["test_accuracy"] for e in ev],
                    color=colors[alg], alpha=0.6, lw=1, label=alg.upper() if i == 0 else None)
    for t in TARGETS:
        ax.axhline(100 * t, color="gray", ls=":", lw=0.8)
    ax.set_xlabel("training time (s)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_ylim(80, 93)
    ax.legend()
    ax.set_title("LeNet / Fashion-MNIST: test accuracy")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "isgd_accuracy.png"), dpi=120)


if __name__ == "__main__":
    main()
