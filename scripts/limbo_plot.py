#!/usr/bin/python3
"""Curves from Limbo run directories (`limbo plot RUN_DIR [RUN_DIR ...]`).

Reads each run's metrics.jsonl (for `launch --mode async` jobs also
shard-0/metrics.jsonl) and draws one PNG with a panel
per quantity that any run logged: training loss, test accuracy, learning
rate, global batch size / worker count, and mean staleness. The x axis is
the epoch. Runs are overlaid, labelled by their directory name.
"""
import argparse
import json
import os
import sys


def read_lines(path):
    out = []
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line cut short by a crash
    return out


def mean_tau(hist):
    n = sum(hist.values())
    return sum(int(t) * c for t, c in hist.items()) / n if n else None


def series(run):
    """{panel: [(x, y), ...]} for one run directory."""
    s = {"loss": [], "test accuracy %": [], "learning rate": [], "batch size / workers": [], "staleness (mean tau)": []}
    lines = read_lines(os.path.join(run, "metrics.jsonl"))
    for r in lines:
        k, e = r.get("kind"), r.get("epoch")
        if e is None:
            continue
        if k in ("train", "sim_updates") and r.get("loss") is not None:
            s["loss"].append((e, r["loss"]))
        if k == "eval" and r.get("test_accuracy") is not None:
            s["test accuracy %"].append((e, 100 * r["test_accuracy"]))
        if k in ("train", "sim_updates") and r.get("lr") is not None:
            s["learning rate"].append((e, r["lr"]))  # already includes any batch-policy multiplier
        if k == "train" and r.get("batch_size") is not None:
            s["batch size / workers"].append((e, r["batch_size"]))
        if k == "sim_updates" and r.get("learners") is not None:
            s["batch size / workers"].append((e, r["learners"]))
        if "staleness_hist" in r and r["staleness_hist"]:
            s["staleness (mean tau)"].append((e, mean_tau(r["staleness_hist"])))
    # Asynchronous jobs: the shard logs staleness, the learners log loss.
    for r in read_lines(os.path.join(run, "shard-0", "metrics.jsonl")):
        if r.get("epoch") is not None and r.get("staleness_hist"):
            s["staleness (mean tau)"].append((r["epoch"], mean_tau(r["staleness_hist"])))
            s["batch size / workers"].append((r["epoch"], r.get("learners")))
    return {k: sorted(v) for k, v in s.items() if v}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="run directories")
    ap.add_argument("--out", help="PNG to write (default: RUN_DIR/curves.png of the first run)")
    args = ap.parse_args()
    missing = [r for r in args.runs if not os.path.isdir(r)]
    if missing:
        print(f"limbo plot: not a run directory: {', '.join(missing)}", file=sys.stderr)
        return 2
    data = {os.path.basename(os.path.normpath(r)): series(r) for r in args.runs}
    panels = [p for p in ("loss", "test accuracy %", "learning rate", "batch size / workers", "staleness (mean tau)")
              if any(p in d for d in data.values())]
    if not panels:
        print("limbo plot: no metrics found (is there a metrics.jsonl?)", file=sys.stderr)
        return 2
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 2.4 * len(panels)), sharex=False, squeeze=False)
    for ax, panel in zip(axes[:, 0], panels):
        for name, d in data.items():
            if panel in d:
                xs, ys = zip(*d[panel])
                ax.plot(xs, ys, "-" if len(xs) > 12 else "o-", label=name, linewidth=1.2, markersize=3)
        ax.set_ylabel(panel)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("epoch")
    axes[0, 0].legend(fontsize=8)
    fig.tight_layout()
    out = args.out or os.path.join(args.runs[0], "curves.png")
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
