#!/usr/bin/python3
"""Augmentation on a data-starved run: does data.augment raise test accuracy?

LeNet on 5,000 Fashion-MNIST training images (data.train_limit) for
--epochs epochs with a cosine learning-rate schedule (optim.lr = --lr),
single process, with data.augment = "" and with
--augment (default "random_crop:2,hflip"), seeds 1..--seeds. The two arms
alternate within each seed (A, B, A, B, ...) so that drift of the machine's
speed hits both alike. Records the final test accuracy, the best per-epoch
test accuracy and the training throughput (samples/s, evaluation excluded).

    experiments/augmentation/run.py [--seeds 3] [--epochs 30] [--lr 0.02] [--out experiments/augmentation/results]

Writes <out>/README.md (table), <out>/accuracy.png (test accuracy per epoch,
mean over seeds) and keeps every run directory under <out>/runs/ (a run
already done is not repeated).
"""
import argparse
import json
import os
import statistics
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))


def run(limbo, run_dir, augment, seed, epochs, train_limit, lr):
    summary = os.path.join(run_dir, "summary.json")
    if not os.path.exists(summary):
        subprocess.run(["rm", "-rf", run_dir], check=True)
        cmd = [limbo, "train", "--run-dir", run_dir, "--set", f"train.seed={seed}",
               "--set", f"train.epochs={epochs}", "--set", f"data.train_limit={train_limit}",
               "--set", "train.progress=false", "--set", f"data.augment={augment}",
               "--set", "optim.schedule=cosine", "--set", f"optim.lr={lr}"]
        print(f"[augmentation experiment] augment='{augment}' seed {seed} ...", flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(summary) as f:
        s = json.load(f)
    curve = []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if r.get("kind") == "eval":
                curve.append((r["epoch"], r["test_accuracy"]))
    return {"accuracy": s["test_accuracy"], "best": max(a for _, a in curve), "curve": curve,
            "samples_per_second": s["samples_per_second"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--limbo", default=os.path.join(HERE, "..", "..", "build", "src", "cli", "limbo"))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--train-limit", type=int, default=5000)
    ap.add_argument("--augment", default="random_crop:2,hflip")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    os.makedirs(os.path.join(args.out, "runs"), exist_ok=True)
    arms = [("none", ""), ("augmented", args.augment)]
    rows = {name: [] for name, _ in arms}
    for seed in range(1, args.seeds + 1):
        for name, aug in arms:
            d = os.path.join(args.out, "runs", f"{name}-seed{seed}")
            rows[name].append(run(args.limbo, d, aug, seed, args.epochs, args.train_limit, args.lr))
    lines = ["# Augmentation on a data-starved run", "",
             f"LeNet on {args.train_limit:,} Fashion-MNIST training images (10,000 test images), "
             f"{args.epochs} epochs, batch 64, cosine schedule from lr {args.lr}, single process, "
             f"seeds 1-{args.seeds}; "
             f"`data.augment = \"{args.augment}\"` against none. The arms alternate within each seed. "
             "Written by `experiments/augmentation/run.py`.", "",
             "| data.augment | final test accuracy % per seed | mean | best-epoch accuracy % (mean) "
             "| samples/s per seed | samples/s median |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, aug in arms:
        acc = [100 * r["accuracy"] for r in rows[name]]
        best = [100 * r["best"] for r in rows[name]]
        sps = [r["samples_per_second"] for r in rows[name]]
        lines.append(f"| {aug or 'none'} | " + ", ".join(f"{a:.2f}" for a in acc)
                     + f" | {statistics.mean(acc):.2f} | {statistics.mean(best):.2f} | "
                     + ", ".join(f"{v:.0f}" for v in sps) + f" | {statistics.median(sps):.0f} |")
    gain = [100 * (b["accuracy"] - a["accuracy"]) for a, b in zip(rows["none"], rows["augmented"])]
    ratio = [b["samples_per_second"] / a["samples_per_second"] for a, b in zip(rows["none"], rows["augmented"])]
    lines += ["", f"Gain per seed (augmented - none, points): " + ", ".join(f"{g:+.2f}" for g in gain)
              + f"; mean {statistics.mean(gain):+.2f}.",
              f"Throughput with augmentation against without, per seed (same seed, adjacent runs): "
              + ", ".join(f"{r:.3f}" for r in ratio) + f"; median {statistics.median(ratio):.3f}."]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write(text)
    print(text)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, aug in arms:
        epochs = [e for e, _ in rows[name][0]["curve"]]
        mean = [statistics.mean(r["curve"][i][1] for r in rows[name]) * 100 for i in range(len(epochs))]
        ax.plot(epochs, mean, marker="o", ms=3, label=aug or "no augmentation")
    ax.set_xlabel("epoch")
    ax.set_ylabel("test accuracy % (mean of seeds)")
    ax.set_title(f"LeNet, {args.train_limit:,} Fashion-MNIST images")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "accuracy.png"), dpi=120)


if __name__ == "__main__":
    main()
