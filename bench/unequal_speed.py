#!/usr/bin/python3
"""Members of unequal speed: 2 workers on one host, one thread each, the
second held to a fraction of a core by a cgroup v1 cpu quota (a real slow
member, scripts/cpu_limit.py; needs root). The same script
(bench/python_loop_worker.py, indexed batches) runs as

  equal    `limbo launch` with the limbo module, equal slices of the batch;
  pace     the same with shares="pace" (slices by each member's pace);
  ddp      torch.distributed + DistributedDataParallel at its best, gloo;
  bound    the same two members as independent plain loops side by side,
           under the same limits, no communication; their rates added.

Contenders run interleaved, --repeats times; each reports global samples/s
over the steps after --warmup (shares by pace need about 60 steps to settle
from equal). Prints each contender's median with its range and the ratios.

    bench/unequal_speed.py [--models mlp] [--fraction 0.5] [--period-us 100000]
                           [--batch 64] [--steps 3000] [--warmup 300] [--repeats 3]

--period-us is the cgroup's cfs period: at 100000 (what container runtimes
use) a member at 50 % runs 50 ms and waits 50 ms, which a step much shorter
than that sees as a member that stops and starts; a short period (e.g.
10000) spreads the same share evenly.
"""
import argparse
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "scripts"))
import cpu_limit  # noqa: E402
import python_loop as pl  # noqa: E402


def bound(model, batch, steps, limit):
    """Two plain loops at once, the second held as the job's second member is."""
    env = dict(os.environ, THREADS="1")
    env.update(pl.HEAP)
    procs = [subprocess.Popen([pl.PY, pl.WORKER, "--mode", "plain", "--model", model, "--batch", str(batch),
                               "--steps", str(steps)] + pl.EXTRA + (["--cpu-limit", "0:" + limit] if held else []),
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for held in (False, True)]
    return sum(pl.last_json(p.communicate(timeout=900)[0])["samples_per_second"] for p in procs)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limbo", default=os.path.join(HERE, "..", "build", "src", "cli", "limbo"))
    ap.add_argument("--models", default="mlp")
    ap.add_argument("--fraction", type=float, default=0.5, help="of a core, for the second member")
    ap.add_argument("--period-us", type=int, default=100000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if not cpu_limit.available():
        sys.exit("unequal_speed: the cgroup v1 cpu controller is not writable here (run as root)")
    limit = "%g:%d" % (args.fraction, args.period_us)
    pl.EXTRA = ["--data", "indexed", "--warmup", str(args.warmup)]
    names = ["equal", "pace", "ddp", "bound"]
    print("2 workers on one host, 1 thread each, the second at %.0f %% of a core (cfs period %d us), batch %d a "
          "member, %d steps (rates after %d), %d repeats, interleaved"
          % (100 * args.fraction, args.period_us, args.batch, args.steps, args.warmup, args.repeats), flush=True)
    print("%-7s %-7s" % ("model", "") + "".join("%12s" % n for n in names) +
          "".join("%14s" % r for r in ("pace/equal", "pace/ddp", "pace/bound", "equal/bound", "ddp/bound")),
          flush=True)
    held = ["--cpu-limit", "1:" + limit]
    for model in args.models.split(","):
        runs = {n: [] for n in names}
        for _ in range(args.repeats):
            extra = pl.EXTRA
            pl.EXTRA = extra + held
            runs["equal"].append(pl.python(args.limbo, model, args.batch, args.steps, data="indexed"))
            pl.EXTRA = extra + held + ["--shares", "pace"]
            runs["pace"].append(pl.python(args.limbo, model, args.batch, args.steps, data="indexed"))
            pl.EXTRA = extra + held
            runs["ddp"].append(pl.ddp(model, args.batch, args.steps, data="indexed"))
            pl.EXTRA = extra
            runs["bound"].append(bound(model, args.batch, args.steps, limit))
        med = {n: statistics.median(v) for n, v in runs.items()}

        def ratio(a, b):
            return statistics.median(x / y for x, y in zip(runs[a], runs[b]))
        print("%-7s %-7s" % (model, "median") + "".join("%12.0f" % med[n] for n in names) +
              "".join("%13.3fx" % ratio(a, b) for a, b in (("pace", "equal"), ("pace", "ddp"), ("pace", "bound"),
                                                           ("equal", "bound"), ("ddp", "bound"))), flush=True)
        print("%-7s %-7s" % ("", "range") + "".join(
            "%12s" % ("%.0f-%.0f" % (min(runs[n]), max(runs[n]))) for n in names), flush=True)


if __name__ == "__main__":
    main()
