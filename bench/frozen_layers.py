#!/usr/bin/python3
"""What frozen layers cost on the wire: a frozen backbone (the MLP's hidden
layers frozen, only its output layer trains), 2 workers on one host, the
same script (bench/python_loop_worker.py,
indexed batches) run as

  may_train  the limbo module, limbo.Job(frozen="may_train") (the default):
             frozen layers in Limbo's flat buffers, in buckets of their own
             that stay off the wire while every member has them frozen, so
             the loop may unfreeze them at any step;
  fixed      limbo.Job(frozen="fixed"): frozen layers out of the buffers;
  ddp        torch.distributed + DistributedDataParallel at its best, gloo
             (it leaves parameters frozen at its making out of its buckets).

Contenders run interleaved, --repeats times. Prints each one's median
global samples/s with its range, and the ratios.

    bench/frozen_layers.py [--models mlp10m,mlp] [--steps 300] [--repeats 3]
"""
import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import python_loop as pl  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limbo", default=os.path.join(HERE, "..", "build", "src", "cli", "limbo"))
    ap.add_argument("--models", default="mlp10m,mlp")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    base = ["--data", "indexed", "--warmup", str(args.warmup), "--freeze-hidden"]
    names = ["may_train", "fixed", "ddp"]
    print("a frozen backbone (the MLP's hidden layers), 2 workers on one host, batch %d a member, %d steps (rates "
          "after %d), %d repeats, interleaved" % (args.batch, args.steps, args.warmup, args.repeats), flush=True)
    print("%-7s %-7s" % ("model", "") + "".join("%12s" % n for n in names) +
          "".join("%17s" % r for r in ("may_train/fixed", "may_train/ddp", "fixed/ddp")), flush=True)
    for model in args.models.split(","):
        runs = {n: [] for n in names}
        for _ in range(args.repeats):
            for mode in ("may_train", "fixed"):
                pl.EXTRA = base + ["--frozen", mode]
                runs[mode].append(pl.python(args.limbo, model, args.batch, args.steps, data="indexed"))
            pl.EXTRA = base
            runs["ddp"].append(pl.ddp(model, args.batch, args.steps, data="indexed"))
        med = {n: statistics.median(v) for n, v in runs.items()}

        def ratio(a, b):
            return statistics.median(x / y for x, y in zip(runs[a], runs[b]))
        print("%-7s %-7s" % (model, "median") + "".join("%12.0f" % med[n] for n in names) +
              "".join("%16.3fx" % ratio(a, b) for a, b in (("may_train", "fixed"), ("may_train", "ddp"),
                                                           ("fixed", "ddp"))), flush=True)
        print("%-7s %-7s" % ("", "range") + "".join(
            "%12s" % ("%.0f-%.0f" % (min(runs[n]), max(runs[n]))) for n in names), flush=True)


if __name__ == "__main__":
    main()
