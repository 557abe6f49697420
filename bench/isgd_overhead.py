#!/usr/bin/python3
"""ISGD's per-step overhead on steps that do not trigger, against plain SGD.

Runs SGD and ISGD (k = 3, defaults otherwise) alternately, several times, on
LeNet / Fashion-MNIST (a 12,800-sample subset: 200 batches per epoch, so most
steps are past the first epoch and really checked), and compares the mean time
of an ISGD step that did not trigger with the mean SGD step. Target: <= 1.02.

    bench/isgd_overhead.py [--limbo build/src/cli/limbo] [--reps 3]
"""
import argparse
import os
import sys
import statistics

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from limbo_run import summary_of  # noqa: E402


def run(limbo, algorithm, epochs, threads):
    return summary_of([limbo, "train"],
                      ["--set", f"optim.algorithm={algorithm}",
                       "--set", "data.order=fixed-cycle", "--set", "data.train_limit=12800",
                       "--set", "data.test_limit=1000", "--set", f"train.epochs={epochs}",
                       "--set", f"train.threads={threads}", "--set", "train.progress=false",
                       "--set", "train.eval_every_epochs=0",
                       "--set", "train.checkpoint_every_epochs=0"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limbo", default="build/src/cli/limbo")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    sgd, isgd = [], []
    print(f"{'rep':>3} {'SGD step (ms)':>14} {'ISGD plain step (ms)':>21} {'ratio':>6} "
          f"{'triggered':>9} {'extra it':>8}")
    for rep in range(args.reps):
        s = run(args.limbo, "sgd", args.epochs, args.threads)
        i = run(args.limbo, "isgd", args.epochs, args.threads)
        s_step = s["train_seconds"] / s["steps"]
        i_step = i["isgd_plain_step_seconds_mean"]
        sgd.append(s_step)
        isgd.append(i_step)
        print(f"{rep:3d} {1e3 * s_step:14.3f} {1e3 * i_step:21.3f} {i_step / s_step:6.3f} "
              f"{i['isgd_triggered_batches']:9d} {i['isgd_extra_iterations']:8d}")
    ratio = statistics.mean(isgd) / statistics.mean(sgd)
    print(f"mean: SGD {1e3 * statistics.mean(sgd):.3f} ms/step, ISGD non-triggering "
          f"{1e3 * statistics.mean(isgd):.3f} ms/step, overhead {100 * (ratio - 1):+.1f}% "
          f"(target <= +2%)")


if __name__ == "__main__":
    main()
