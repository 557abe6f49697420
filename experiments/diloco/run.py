#!/usr/bin/python3
"""The GPT example across 100 Mbit/s links while members come and go:
every-step synchronisation against DiLoCo and streaming DiLoCo, several
seeds.

Four hosts (network namespaces on a bridge, each link shaped both ways by the
kernel's token bucket, bench/slow_link.py's Hosts), one `limbo launch` of one
worker each. The schedule by the samples trained (of the budget): all 4
hosts at the start; at 25 % hosts 2 and 3 leave (SIGTERM to their launchers:
each worker leaves at the next step boundary); at 50 % host 2 comes back (a
new launcher, a new worker that joins); at 75 % host 3 comes back: 4 -> 2 ->
3 -> 4. Each mode trains the same sample budget from the same seed, with the
example's schedule over that budget.

    experiments/diloco/run.py [--seeds 3] [--samples 48000] [--rate 100mbit]
                              [--modes step-bf16,diloco50-int8,stream50-int8] [--out experiments/diloco/results]

Needs root, iproute2 (tc) and the GPT's data (examples/gpt/setup.sh). Writes
<out>/README.md (table) and <out>/loss.png (held-out loss against training
time, every seed), and keeps every run's records under <out>/runs/ (a run
already done is not repeated).
"""
import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import slow_link  # noqa: E402

SCHEDULE = [(0.25, "leave", 2), (0.25, "leave", 3), (0.5, "join", 2), (0.75, "join", 3)]


def samples_so_far(run):
    """The samples committed so far: the last train record's count (step),
    or the sum of the outer records' (DiLoCo)."""
    path = os.path.join(run, "metrics.jsonl")
    train, outer = 0, 0
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        for line in f:
            try:
                r = json.loads(line)
            except ValueError:
                continue  # a line being written
            if r.get("kind") == "train":
                train = max(train, r.get("samples", 0))
            elif r.get("kind") == "outer":
                outer += r.get("samples", 0)
    return max(train, outer)


def run_one(limbo, hosts, mode, seed, samples, run):
    margs, batch, train_size = slow_link.model_args("gpt")
    sets = slow_link.MODES[mode]
    inner, fragments = 1, 1
    for s in sets:
        if s.startswith("diloco.inner_steps="):
            inner = int(s.split("=")[1])
        if s.startswith("diloco.fragments="):
            fragments = int(s.split("=")[1])
    n = len(hosts.ns)
    # At 4 members (fewer members make the steps smaller); streaming's unit
    # is inner / fragments inner steps.
    steps = max(1, samples // (batch * n * inner // fragments))
    args = margs + ["--set", "data.batch_size=%d" % batch, "--set", "train.epochs=%d" % (samples // train_size + 1),
                    "--set", "optim.cosine_epochs=%g" % (samples / train_size), "--set", "train.seed=%d" % seed,
                    "--set", "train.threads=1", "--set", "train.progress=false",
                    "--set", "train.eval_every_steps=%d" % max(1, steps // 8), "--set", "train.eval_every_epochs=0",
                    "--set", "train.checkpoint_every_epochs=0", "--set", "diloco.max_wait=0",
                    "--set", "elastic.shares=\"equal\"",
                    "--set", "elastic.collective_timeout=600"]
    # The budget in samples: train.max_steps would count steps of changing size.
    for s in sets:
        args += ["--set", s]
    rdzv = "%s:%d" % (hosts.ip[0], 29900 + os.getpid() % 90)
    shutil.rmtree(run, ignore_errors=True)
    os.makedirs(run)
    procs = {}

    def start(h):
        log = open(os.path.join(run, "host%d.log" % h), "a")
        procs[h] = subprocess.Popen(["ip", "netns", "exec", hosts.ns[h], limbo, "launch", "--nproc", "1",
                                     "--min-workers", "1", "--rdzv", rdzv, "--run-dir", run,
                                     "--rdzv-timeout", "600", "--"] + args,
                                    stdout=log, stderr=subprocess.STDOUT)

    for h in range(n):
        start(h)
        time.sleep(0.5)
    events = list(SCHEDULE)
    t0 = time.time()
    log = []
    while procs[0].poll() is None:
        done = samples_so_far(run)
        while events and done >= events[0][0] * samples:
            frac, what, h = events.pop(0)
            if what == "leave":
                procs[h].send_signal(signal.SIGTERM)
            else:
                procs[h].wait()
                start(h)
            log.append({"t": time.time() - t0, "samples": done, "event": what, "host": h})
        if done >= samples:
            # The budget is spent: every launcher stops its workers after a checkpoint.
            for p in procs.values():
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            break
        time.sleep(0.2)
    for p in procs.values():
        try:
            p.wait(timeout=600)
        except subprocess.TimeoutExpired:
            p.kill()
    with open(os.path.join(run, "events.json"), "w") as f:
        json.dump(log, f)


def read(run):
    curve = []
    with open(os.path.join(run, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if r.get("kind") == "eval" and r.get("test_loss") is not None:
                curve.append((r["train_seconds"], r["test_loss"]))
    return curve


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limbo", default=os.path.join(ROOT, "build/src/cli/limbo"))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--samples", type=int, default=48000)
    ap.add_argument("--rate", default="100mbit")
    ap.add_argument("--modes", default="step-bf16,diloco50-int8,stream50-int8")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (network namespaces and tc)")
    modes = args.modes.split(",")
    os.makedirs(os.path.join(args.out, "runs"), exist_ok=True)
    curves = {}
    for seed in range(1, args.seeds + 1):
        for mode in modes:
            run = os.path.join(args.out, "runs", "%s-seed%d" % (mode, seed))
            if not os.path.exists(os.path.join(run, "done")):
                hosts = slow_link.Hosts(4, args.rate)
                try:
                    print("[diloco experiment] %s seed %d ..." % (mode, seed), flush=True)
                    run_one(args.limbo, hosts, mode, seed, args.samples, run)
                finally:
                    hosts.close()
                open(os.path.join(run, "done"), "w").close()
            curves[(mode, seed)] = read(run)
    # The table: the held-out loss at the end of each run (its last
    # evaluation) and at the wall time T the fastest run took.
    t_eq = min(c[-1][0] for c in curves.values() if c)
    rows = []
    for mode in modes:
        finals = [curves[(mode, s)][-1][1] for s in range(1, args.seeds + 1) if curves[(mode, s)]]
        at_t = [slow_link.loss_at([(t, l, 0) for t, l in curves[(mode, s)]], t_eq)
                for s in range(1, args.seeds + 1)]
        at_t = [x for x in at_t if x is not None]
        secs = [curves[(mode, s)][-1][0] for s in range(1, args.seeds + 1) if curves[(mode, s)]]
        rows.append((mode, finals, at_t, secs))
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write("# GPT across %s links, 4 -> 2 -> 3 -> 4 members: step against DiLoCo and streaming DiLoCo\n\n" % args.rate)
        f.write("`experiments/diloco/run.py --seeds %d --samples %d --rate %s --modes %s`; "
                "%d seeds, held-out loss (nats/byte) as median [min-max]. T = %.1f s of training, the fastest "
                "run's.\n\n" % (args.seeds, args.samples, args.rate, args.modes, args.seeds, t_eq))
        f.write("| mode | training seconds | held-out loss at the end | held-out loss at T |\n| --- | --- | --- | --- |\n")

        def cell(v, d):
            return "%.*f [%.*f-%.*f]" % (d, statistics.median(v), d, min(v), d, max(v)) if v else "-"
        for mode, finals, at_t, secs in rows:
            f.write("| %s | %s | %s | %s |\n" % (mode, cell(secs, 1), cell(finals, 4), cell(at_t, 4)))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4.5))
        colors = {}
        for (mode, seed), c in sorted(curves.items()):
            if not c:
                continue
            color = colors.setdefault(mode, "C%d" % len(colors))
            ax.plot([t for t, _ in c], [l for _, l in c], color=color, alpha=0.8,
                    label=mode if seed == 1 else None)
        ax.set_xlabel("training seconds")
        ax.set_ylabel("held-out loss (nats/byte)")
        ax.set_title("GPT, 4 -> 2 -> 3 -> 4 members over %s links" % args.rate)
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "loss.png"), dpi=100)
    except ImportError:
        print("matplotlib is missing: no plot", file=sys.stderr)
    print(open(os.path.join(args.out, "README.md")).read())


if __name__ == "__main__":
    main()
