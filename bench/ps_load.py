#!/usr/bin/python3
"""Parameter-server load: can one shard keep up with many learners, and what
do two shards buy on a large model? Prints figures side by side.

1. LeNet, L learners (default 8) against one shard (softsync, n = L, i.e.
   an update per gradient): the shard's busy fraction (time spent handling
   messages / wall time), updates/s, and the learners' total samples/s beside
   a single `limbo train` process on the same machine (the baseline: all
   cores, no server).
2. A large MLP (default width 2048, depth 3: ~10M parameters), 2 learners,
   1 shard against 2 shards: updates/s, samples/s, busy fractions.

    bench/ps_load.py [--limbo build/src/cli/limbo] [--learners 8] [--samples 8000]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from limbo_run import summary_of  # noqa: E402


def job(limbo, servers, workers, n, args, extra):
    return summary_of([limbo, "launch", "--mode", "async", "--servers", str(servers), "--workers", str(workers),
                       "--protocol", "softsync", "--softsync-n", str(n)],
                      ["--", "--set", "train.epochs=1", "--set", f"data.train_limit={args.samples}",
                       "--set", "data.test_limit=1000", "--set", "train.progress=false",
                       "--set", "ps.log_every=1000000"] + extra)


def single(limbo, args, extra):
    return summary_of([limbo, "train"],
                      ["--set", "train.epochs=1", "--set", f"data.train_limit={args.samples}",
                       "--set", "data.test_limit=1000", "--set", "train.progress=false",
                       "--set", "train.eval_every_epochs=0", "--set", "train.checkpoint_every_epochs=0"] + extra)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limbo", default="build/src/cli/limbo")
    ap.add_argument("--learners", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8000)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=3)
    args = ap.parse_args()

    lenet = ["--set", "model.name=lenet", "--set", "optim.lr=0.01"]
    base = single(args.limbo, args, lenet)
    s = job(args.limbo, 1, args.learners, args.learners, args, lenet)
    sh = s["shards"][0]
    print(f"1. LeNet, {args.learners} learners, 1 shard, softsync n = {args.learners} ({args.samples} samples)")
    print(f"   {'':28} {'samples/s':>10} {'updates/s':>10} {'shard busy':>11}")
    print(f"   {'limbo train (1 process)':28} {base['samples_per_second']:10.0f} {'-':>10} {'-':>11}")
    print(f"   {'async job, all learners':28} {s['samples_per_second']:10.0f} "
          f"{s['updates'] / s['wall_seconds']:10.1f} {100 * sh['busy_fraction']:10.1f}%")
    print(f"   ratio async / single process: {s['samples_per_second'] / base['samples_per_second']:.2f}x; "
          f"staleness mean {s['staleness_mean']:.2f}, max {s['staleness_max']}\n")

    big = ["--set", "model.name=mlp", "--set", f"model.width={args.width}", "--set", f"model.depth={args.depth}",
           "--set", "optim.lr=0.01"]
    print(f"2. MLP width {args.width} depth {args.depth}, 2 learners, softsync n = 2")
    print(f"   {'':10} {'samples/s':>10} {'updates/s':>10} {'busy per shard':>20} {'wall s':>8}")
    rows = {}
    for servers in (1, 2):
        r = job(args.limbo, servers, 2, 2, args, big)
        rows[servers] = r
        busy = ", ".join(f"{100 * x['busy_fraction']:.0f}%" for x in r["shards"])
        print(f"   {servers} shard{'s' if servers > 1 else ' '} {r['samples_per_second']:10.0f} "
              f"{r['updates'] / r['wall_seconds']:10.1f} {busy:>20} {r['wall_seconds']:8.1f}")
    print(f"   2 shards / 1 shard: {rows[2]['samples_per_second'] / rows[1]['samples_per_second']:.2f}x samples/s")


if __name__ == "__main__":
    sys.exit(main())
