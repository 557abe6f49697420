#!/usr/bin/python3
"""Staleness-aware async SGD (Zhang et al., shape only): lambda learners
against a parameter server under n-softsync for several n, with a constant
learning rate against alpha0 / tau, plus a hardsync baseline.

Real processes via `limbo launch --mode async` (one shard), or with --sim
the virtual cluster of `limbo sim` (same aggregator and update code) at the
paper's scale. Fashion-MNIST, per-learner batch --batch, server-side
momentum 0.9. Writes table.md (test error for each n and policy, mean and
spread over seeds, plus the measured staleness) and PNG plots into --out.

    experiments/staleness/run.py [--learners 4] [--ns 1,2,4] [--seeds 1,2,3]
                                 [--epochs 2] [--lr 0.03] [--out experiments/staleness/results]
    experiments/staleness/run.py --sim      # lambda = 30, n = 1,2,4,10,30, LeNet, batch 8
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess


def run(args, name, protocol, n, policy, seed):
    d = os.path.join(args.out, "runs", f"{name}-seed{seed}")
    if os.path.exists(os.path.join(d, "summary.json")):
        return json.load(open(os.path.join(d, "summary.json")))
    shutil.rmtree(d, ignore_errors=True)
    print(f"[staleness experiment] {name} seed {seed} ...", flush=True)
    if args.sim:
        cmd = [args.limbo, "sim", "--run-dir", d, "--set", f"sim.learners={args.learners}",
               "--set", f"ps.protocol={protocol}", "--set", f"ps.softsync_n={max(n, 1)}",
               "--set", f"sim.compute={args.compute}"]
    else:
        cmd = [args.limbo, "launch", "--mode", "async", "--servers", "1", "--workers", str(args.learners),
               "--protocol", protocol, "--run-dir", d]
        if protocol == "softsync":
            cmd += ["--softsync-n", str(n)]
        cmd += ["--"]
    cmd += ["--set", f"model.name={args.model}", "--set", f"data.batch_size={args.batch}",
            "--set", f"optim.lr={args.lr}", "--set", "optim.momentum=0.9", "--set", f"train.seed={seed}",
            "--set", f"train.epochs={args.epochs}", "--set", f"ps.staleness={policy}",
            "--set", "train.progress=false", "--set", "ps.log_every=50"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.load(open(os.path.join(d, "summary.json")))


def fmt(values):
    m = statistics.mean(values)
    s = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{m:.2f} ± {s:.2f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limbo", default="build/src/cli/limbo")
    ap.add_argument("--learners", type=int, default=4)
    ap.add_argument("--ns", default="1,2,4")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=0.03)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--out", default="experiments/staleness/results")
    ap.add_argument("--sim", action="store_true",
                    help="use `limbo sim` (virtual learners); defaults become the paper's lambda = 30")
    ap.add_argument("--compute", default="normal", help="--sim: compute-time distribution")
    args = ap.parse_args()
    if args.sim:  # the paper's scale, unless given
        given = {a.split("=")[0] for a in os.sys.argv[1:]}
        for flag, value in (("--learners", 30), ("--ns", "1,2,4,10,30"), ("--seeds", "1"), ("--model", "lenet"),
                            ("--batch", 8), ("--lr", 0.01), ("--out", "experiments/staleness/results-sim")):
            if flag not in given:
                setattr(args, flag[2:], value)
    os.makedirs(args.out, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    ns = [int(n) for n in args.ns.split(",")]

    rows = []
    hard = [run(args, "hardsync", "hardsync", 0, "constant", s) for s in seeds]
    rows.append(("hardsync", "-", "-", hard))
    results = {}
    for policy in ("constant", "inverse"):
        for n in ns:
            rs = [run(args, f"softsync{n}-{policy}", "softsync", n, policy, s) for s in seeds]
            results[(policy, n)] = rs
            rows.append((f"{n}-softsync", n, policy, rs))

    kind = "virtual learners (limbo sim, compute times: " + args.compute + ")" if args.sim else "learner processes"
    lines = [f"# Staleness-aware async SGD: lambda = {args.learners} {kind}, {args.model}, "
             f"Fashion-MNIST, {args.epochs} epochs, batch {args.batch} per learner, alpha0 = {args.lr}, "
             f"server momentum 0.9, seeds {args.seeds}", "",
             "| protocol | n | learning rate | test error % | staleness mean | staleness p99 | staleness max | updates | "
             + ("accepted samples per virtual s |" if args.sim else "samples/s |"),
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    rate = (lambda r: r["gradients_accepted"] * args.batch / r["virtual_seconds"]) if args.sim else \
        (lambda r: r["samples_per_second"])
    for name, n, policy, rs in rows:
        err = [100 * (1 - r["test_accuracy"]) for r in rs]
        lines.append(f"| {name} | {n} | {policy} | {fmt(err)} | "
                     f"{statistics.mean(r['staleness_mean'] for r in rs):.2f} | "
                     f"{max(r['staleness_p99'] for r in rs)} | {max(r['staleness_max'] for r in rs)} | "
                     f"{statistics.mean(r['updates'] for r in rs):.0f} | "
                     f"{statistics.mean(rate(r) for r in rs):.0f} |")
    table = "\n".join(lines) + "\n"
    open(os.path.join(args.out, "table.md"), "w").write(table)
    print(table)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    herr = statistics.mean(100 * (1 - r["test_accuracy"]) for r in hard)
    ax.axhline(herr, color="gray", linestyle="--", label="hardsync")
    for policy, style in (("constant", "o-"), ("inverse", "s-")):
        ys = [statistics.mean(100 * (1 - r["test_accuracy"]) for r in results[(policy, n)]) for n in ns]
        ax.plot(ns, ys, style, label=f"{policy} (alpha0{'/tau' if policy == 'inverse' else ''})")
    ax.set_xlabel("n (n-softsync)")
    ax.set_ylabel("test error %")
    ax.set_xticks(ns)
    ax.set_title(f"lambda = {args.learners}: test error vs n")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "error_vs_n.png"), dpi=120)

    fig, ax = plt.subplots(figsize=(6, 4))
    for n in ns:
        hist = {}
        for r in results[("inverse", n)]:
            for t, c in r["staleness_hist"].items():
                hist[int(t)] = hist.get(int(t), 0) + c
        total = sum(hist.values())
        ts = sorted(hist)
        ax.plot(ts, [hist[t] / total for t in ts], "o-", label=f"n = {n}")
    ax.set_xlabel("staleness tau")
    ax.set_ylabel("fraction of gradients")
    ax.set_yscale("log")
    ax.set_title("staleness distribution (inverse runs)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "staleness.png"), dpi=120)


if __name__ == "__main__":
    main()
