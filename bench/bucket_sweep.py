#!/usr/bin/python3
"""Gradient bucket size (elastic.bucket_mb) against throughput, with the
all-reduce overlapped with backward: `limbo launch --nproc 2` (2 workers x 1
thread on loopback, per-worker batch 64) for each size, interleaved, --repeats
times. Prints the median global samples/s, its ratio to the best size, and
Limbo's exposed communication per step (ms the training thread waited for
the all-reduce after backward). How the default of elastic.bucket_mb was
chosen.

    bench/bucket_sweep.py [--limbo build/src/cli/limbo] [--sizes 0,0.25,1,4,16]
                          [--models mlp,lenet,mlp10m] [--repeats 3]
"""
import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ddp_throughput as dt  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--limbo", default="build/src/cli/limbo")
    ap.add_argument("--sizes", default="0,0.25,1,4,16")
    ap.add_argument("--models", default="mlp,lenet,mlp10m")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--big-steps", type=int, default=80)
    args = ap.parse_args()
    sizes = [float(x) for x in args.sizes.split(",")]
    print(f"2 workers x 1 thread on loopback, batch 64 per worker, overlap on, {args.repeats} interleaved "
          f"repeats; samples/s (median), ratio to the best size, exposed communication ms/step")
    for name in args.models.split(","):
        steps = args.big_steps if name == "mlp10m" else args.steps
        rates = {b: [] for b in sizes}
        for _ in range(args.repeats):
            for b in sizes:
                rates[b].append(dt.limbo_rate(args.limbo, name, 64, steps, bucket_mb=b))
        best = max(statistics.median(v) for v in rates.values())
        cells = []
        for b in sizes:
            med = statistics.median(rates[b])
            ex = statistics.median(dt.EXPOSED[(name, "none", True, b)])
            cells.append(f"{b:g} MiB: {med:7.0f} ({med / best:.2f}, {ex:.1f} ms)")
        print(f"{name:7} " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
