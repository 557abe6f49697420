#!/usr/bin/python3
"""Simulator cost beyond the gradient computations it has to do.

Side by side, for the same model, batch and number of gradients:
  * `limbo train` (one process, SGD) - the baseline: gradients plus a local
    SGD step each;
  * `limbo sim` asynchronous (lambda virtual learners, n-softsync): its own
    measure of time spent in batch + forward + backward vs. its wall time;
  * `limbo sim` elastic (R virtual workers per step).
Prints samples/s of each and the simulation overhead.

    bench/sim_overhead.py [--limbo build/src/cli/limbo] [--model lenet] [--batch 64]
                          [--samples 20000] [--learners 30] [--threads 2]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from limbo_run import summary_of  # noqa: E402


def limbo(args, sub, extra):
    return summary_of([args.limbo, sub],
                      ["--set", f"model.name={args.model}",
                       "--set", f"data.batch_size={args.batch}", "--set", f"data.train_limit={args.samples}",
                       "--set", "data.test_limit=500", "--set", "train.epochs=1", "--set", "train.progress=false",
                       "--set", f"train.threads={args.threads}", "--set", "optim.lr=0.01",
                       "--set", "ps.log_every=1000000", "--set", "train.log_every=1000000"] + extra)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limbo", default="build/src/cli/limbo")
    ap.add_argument("--model", default="lenet")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--samples", type=int, default=20000)
    ap.add_argument("--learners", type=int, default=30)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    base = limbo(args, "train", ["--set", "train.eval_every_epochs=0", "--set", "train.checkpoint_every_epochs=0"])
    asim = limbo(args, "sim", ["--set", f"sim.learners={args.learners}", "--set", f"ps.softsync_n={args.learners}",
                               "--set", "optim.momentum=0"])
    esim = limbo(args, "sim", ["--set", "sim.mode=elastic", "--set", f"sim.elastic_schedule=0:{args.workers}",
                               "--set", f"data.batch_size={max(1, args.batch // args.workers)}"])
    n = args.samples
    print(f"{args.model}, batch {args.batch}, {n} samples, {args.threads} threads\n")
    print(f"{'':44} {'samples/s':>10} {'overhead':>9}")
    print(f"{'limbo train (baseline)':44} {base['samples_per_second']:10.0f} {'-':>9}")
    a_rate = asim["gradients_accepted"] * args.batch / asim["wall_seconds"]
    print(f"{'limbo sim async, %d learners, %d-softsync' % (args.learners, args.learners):44} {a_rate:10.0f} "
          f"{100 * asim['overhead_fraction']:8.1f}%")
    e_rate = esim["samples"] / esim["wall_seconds"]
    print(f"{'limbo sim elastic, %d workers x batch %d' % (args.workers, max(1, args.batch // args.workers)):44} "
          f"{e_rate:10.0f} {100 * esim['overhead_fraction']:8.1f}%")
    print(f"\nasync sim / train: {a_rate / base['samples_per_second']:.2f}x; "
          f"snapshot versions at peak: {asim['snapshot_versions_peak']} "
          f"({asim['snapshot_bytes_peak'] / 2**20:.1f} MiB)")


if __name__ == "__main__":
    sys.exit(main())
