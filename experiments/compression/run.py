#!/usr/bin/python3
"""16-bit gradients against float32 on the default jobs, several seeds.

Data-parallel: `limbo launch --nproc 2` with the default configuration
(LeNet on Fashion-MNIST, 2 epochs) and comm.compression = none, bf16, fp16.
Parameter server: `limbo launch --mode async --servers 1 --workers 2` with
the default configuration and comm.compression = ps.pull_compression = none,
then bf16. Each with --seeds seeds (train.seed). Records the final test
accuracy and loss of every run and the bytes each shard took in.

    experiments/compression/run.py [--seeds 3] [--epochs 2] [--out experiments/compression/results]

Writes <out>/README.md (table) and keeps every run directory under <out>/runs/
(a run already done is not repeated).
"""
import argparse
import json
import os
import statistics
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))


def run(limbo, run_dir, mode, compression, seed, epochs):
    summary = os.path.join(run_dir, "summary.json")
    if not os.path.exists(summary):
        subprocess.run(["rm", "-rf", run_dir], check=True)
        common = ["--set", f"train.seed={seed}", "--set", f"train.epochs={epochs}",
                  "--set", "train.progress=false", "--set", f"comm.compression={compression}"]
        if mode == "allreduce":
            cmd = [limbo, "launch", "--nproc", "2", "--", "--run-dir", run_dir] + common
        else:
            cmd = [limbo, "launch", "--mode", "async", "--servers", "1", "--workers", "2",
                   "--run-dir", run_dir, "--"] + common + ["--set", f"ps.pull_compression={compression}"]
        print(f"[compression experiment] {mode} {compression} seed {seed} ...", flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(summary) as f:
        s = json.load(f)
    row = {"accuracy": s["test_accuracy"], "loss": s["test_loss"], "seconds": s.get("wall_seconds")}
    shard = os.path.join(run_dir, "shard-0", "summary.json")
    if os.path.exists(shard):
        with open(shard) as f:
            sh = json.load(f)
        pushes = sh["gradients_accepted"] + sh["gradients_dropped"]
        row["bytes_per_push"] = sh["push_payload_bytes"] / max(pushes, 1)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--limbo", default=os.path.join(HERE, "..", "..", "build", "src", "cli", "limbo"))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    os.makedirs(os.path.join(args.out, "runs"), exist_ok=True)
    cases = [("allreduce", "none"), ("allreduce", "bf16"), ("allreduce", "fp16"),
             ("async", "none"), ("async", "bf16")]
    rows = {}
    for seed in range(1, args.seeds + 1):  # seeds outermost: a partial run still compares like with like
        for mode, comp in cases:
            d = os.path.join(args.out, "runs", f"{mode}-{comp}-seed{seed}")
            rows.setdefault((mode, comp), []).append(run(args.limbo, d, mode, comp, seed, args.epochs))
    lines = ["# 16-bit gradients against float32 on the default jobs", "",
             f"LeNet on Fashion-MNIST (60k training, 10k test images), {args.epochs} epochs, seeds 1-{args.seeds}; "
             "data-parallel: `limbo launch --nproc 2`; parameter server: `limbo launch --mode async "
             "--servers 1 --workers 2` (16-bit pulls too). Written by `experiments/compression/run.py`.", "",
             "| job | wire | test accuracy % per seed | mean | spread (max-min) | bytes per push |",
             "| --- | --- | --- | --- | --- | --- |"]
    for mode, comp in cases:
        acc = [100 * r["accuracy"] for r in rows[(mode, comp)]]
        bpp = [r.get("bytes_per_push") for r in rows[(mode, comp)] if r.get("bytes_per_push")]
        lines.append(f"| {'data-parallel' if mode == 'allreduce' else 'parameter server'} | {comp} | "
                     + ", ".join(f"{a:.2f}" for a in acc)
                     + f" | {statistics.mean(acc):.2f} | {max(acc) - min(acc):.2f} | "
                     + (f"{statistics.mean(bpp):.0f}" if bpp else "-") + " |")
    # Noise: float32's own spread across seeds against the gap of each 16-bit setting.
    lines += ["", "Gap to float32 (mean over seeds, percentage points) against float32's own seed-to-seed spread:", ""]
    for mode in ("allreduce", "async"):
        base = [100 * r["accuracy"] for r in rows[(mode, "none")]]
        for comp in ("bf16", "fp16"):
            if (mode, comp) not in rows:
                continue
            acc = [100 * r["accuracy"] for r in rows[(mode, comp)]]
            lines.append(f"- {mode} {comp}: {statistics.mean(acc) - statistics.mean(base):+.2f} "
                         f"(float32 spread {max(base) - min(base):.2f})")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
