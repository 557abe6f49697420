#!/usr/bin/python3
"""A member whose pace changes while the job runs: shares of the batch by
pace against equal shares, and against the bound, over time.

`limbo launch --nproc 2` runs `limbo train` (the MLP on Fashion-MNIST, one
thread a worker); one of its two workers is held by a cgroup v1 cpu quota
(scripts/cpu_limit.py; needs root) that switches between --high and --low
of a core every --every seconds (100 % -> 30 % -> 100 % ...), from the
moment both workers are up. Each seed trains the same epochs with
`elastic.shares = equal` and with `= pace`, interleaved. The bound: the
same two members as two independent `limbo train` processes side by side
(no communication), the second held by the same schedule, their rates
added.

    experiments/changing_pace/run.py [--seeds 1,2,3] [--epochs 40] [--batch 2048]
                                     [--high 1.0] [--low 0.3] [--every 20]
                                     [--out experiments/changing_pace/results]

Writes <out>/README.md (the table: samples/s in each phase of the limit,
the whole run, the accuracy at the end) and <out>/rate.png (global samples/s
against time, each mode and the bound, with the limit drawn under it), and
keeps each run's records under <out>/runs/.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import cpu_limit  # noqa: E402

GROUP = "limbo-changing-pace-%d" % os.getpid()


def train_args(a, seed, run_dir, shares=None, epochs=None):
    s = ["--run-dir", run_dir, "--set", "model.name=mlp", "--set", "data.batch_size=%d" % a.batch,
         "--set", "train.epochs=%d" % (epochs or a.epochs), "--set", "train.seed=%d" % seed,
         "--set", "train.threads=1", "--set", "train.progress=false",
         "--set", "train.eval_every_epochs=%d" % (epochs or a.epochs), "--set", "train.checkpoint_every_epochs=0",
         "--set", "optim.lr=%g" % a.lr, "--set", "optim.momentum=0.9", "--set", "train.log_every=2"]
    if shares:
        s += ["--set", "elastic.shares=%s" % shares]
    return s


def children(pid):
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open("/proc/%s/stat" % p) as f:
                    st = f.read()
            except OSError:
                continue
            if int(st[st.rindex(")") + 2:].split()[1]) == pid:
                out.append(int(p))
    return sorted(out)


class Records:
    """Train records of a metrics.jsonl, each stamped with the time it was
    first seen (polled every 0.05 s), as (seconds since t0, samples)."""

    def __init__(self, path):
        self.path, self.pos, self.points, self.accuracy = path, 0, [], None
        self.shares = []  # (seconds since t0, step, the held member's share) of each train record


    def poll(self, t0):
        if not os.path.exists(self.path):
            return
        with open(self.path) as f:
            f.seek(self.pos)
            chunk = f.read()
        end = chunk.rfind("\n") + 1
        self.pos += end
        for line in chunk[:end].splitlines():
            r = json.loads(line)
            if r.get("kind") == "train":
                self.points.append((time.monotonic() - t0, r["samples"]))
                if "shares" in r and len(r["shares"]) == 2:
                    self.shares.append((time.monotonic() - t0, r["step"], r["shares"][1]))
            elif r.get("kind") == "eval":
                self.accuracy = r["test_accuracy"]


def drive(procs, held_pid_of, records, a, deadline=None):
    """Runs the limit's schedule until every process exits (or deadline
    seconds after t0: then they are stopped). Returns t0."""
    cpu_limit.limit(GROUP, a.high, a.period_us)
    held, t0 = None, None
    low = False
    while any(p.poll() is None for p in procs):
        if held is None:
            held = held_pid_of()
            if held:
                cpu_limit.add(GROUP, held)
                t0, switched = time.monotonic(), time.monotonic()
        if t0 is not None:
            for r in records:
                r.poll(t0)
            if time.monotonic() - switched >= a.every:
                low, switched = not low, switched + a.every
                cpu_limit.limit(GROUP, a.low if low else a.high, a.period_us)
            if deadline and time.monotonic() - t0 > deadline:
                for p in procs:
                    p.terminate()
        time.sleep(0.05)
    for r in records:
        r.poll(t0 or time.monotonic())
    cpu_limit.remove(GROUP)
    return t0


def job(a, seed, shares, run_dir):
    shutil.rmtree(run_dir, ignore_errors=True)
    env = dict(os.environ)
    launcher = subprocess.Popen([a.limbo, "launch", "--nproc", "2"] + train_args(a, seed, run_dir)[:2] + ["--"] +
                                train_args(a, seed, run_dir, shares)[2:],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def second_worker():
        kids = children(launcher.pid)
        return kids[-1] if len(kids) >= 2 else None
    rec = Records(os.path.join(run_dir, "metrics.jsonl"))
    drive([launcher], second_worker, [rec], a)
    if launcher.wait():
        raise RuntimeError("limbo launch exited %d: %s" % (launcher.returncode, launcher.stderr.read()[-2000:]))
    return rec


def bound(a, seed, run_dir, seconds):
    """Two plain `limbo train` processes side by side for `seconds`, the second held."""
    shutil.rmtree(run_dir, ignore_errors=True)
    procs, recs = [], []
    for k in range(2):
        d = os.path.join(run_dir, str(k))
        procs.append(subprocess.Popen([a.limbo, "train"] + train_args(a, seed, d, epochs=10 * a.epochs),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        recs.append(Records(os.path.join(d, "metrics.jsonl")))
    drive(procs, lambda: procs[1].pid, recs, a, deadline=seconds)
    return recs


def rate_series(points, step=2.0):
    """(t, samples/s) in bins of `step` seconds on a grid from 0 (the same
    for every run), from (t, samples so far)."""
    out = []
    if len(points) < 2:
        return out
    t, end = step * int(points[0][0] // step + 1), points[-1][0]
    while t + step <= end:
        lo = [p for p in points if p[0] <= t][-1:] or [points[0]]
        hi = [p for p in points if p[0] <= t + step][-1]
        if hi[0] > lo[0][0]:
            out.append((t + step / 2, (hi[1] - lo[0][1]) / (hi[0] - lo[0][0])))
        t += step
    return out


def phase_rates(points, a, upto):
    """Samples/s in the high and in the low phases (each phase's first 2 s left
    out: the shares follow within a few steps), over [0, upto)."""
    hi, lo = [0.0, 0.0], [0.0, 0.0]
    for (t0, s0), (t1, s1) in zip(points, points[1:]):
        if t1 > upto:
            break
        ph = t0 % (2 * a.every)
        if ph % a.every < 2.0 or (t1 % (2 * a.every) < ph):
            continue  # the first 2 s of a phase, or a pair that spans a switch
        acc = lo if ph >= a.every else hi
        acc[0] += s1 - s0
        acc[1] += t1 - t0
    return (hi[0] / hi[1] if hi[1] else float("nan")), (lo[0] / lo[1] if lo[1] else float("nan"))


def follow(shares, a):
    """For each switch of the limit after the first phase: the steps from the
    switch until the held member's share has covered three quarters of its
    move (from its value at the switch to its median over the last 40 % of
    the phase's records). A record is stamped with the time it was seen, so
    a switch's step is known to about a record (2 steps)."""
    out, k = [], 1
    while shares and (k + 1) * a.every <= shares[-1][0]:
        t = k * a.every
        before = [x for x in shares if x[0] < t]
        phase = [x for x in shares if t <= x[0] < t + a.every]
        k += 1
        if not before or len(phase) < 10:
            continue
        at, settled = before[-1][2], statistics.median(x[2] for x in phase[len(phase) * 6 // 10:])
        if abs(at - settled) < 0.05:
            continue  # no move to follow
        switch_step = before[-1][1]
        hit = next((x for x in phase if abs(x[2] - settled) <= 0.25 * abs(at - settled)), None)
        if hit:
            out.append(hit[1] - switch_step)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limbo", default=os.path.join(ROOT, "build", "src", "cli", "limbo"))
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch", type=int, default=2048, help="samples a member (equal shares)")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--high", type=float, default=1.0, help="the held member's limit, of a core, in high phases")
    ap.add_argument("--low", type=float, default=0.3)
    ap.add_argument("--every", type=float, default=20.0, help="seconds between switches")
    ap.add_argument("--period-us", type=int, default=100000, help="the cgroup's cfs period")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--modes", default="equal,pace,bound",
                    help="which runs to make (the table and plot need all three; with fewer, each run's "
                         "row is printed only)")
    ap.add_argument("--only-bound", action="store_true",
                    help="run the bound again for --seeds (for the length of each seed's pace run in "
                         "<out>/rows.json) and rewrite the table and plot with it")
    a = ap.parse_args()
    if not cpu_limit.available():
        sys.exit("changing_pace: the cgroup v1 cpu controller is not writable here (run as root)")
    os.makedirs(os.path.join(a.out, "runs"), exist_ok=True)
    rows, series = [], {}
    if a.only_bound:
        with open(os.path.join(a.out, "rows.json")) as f:
            saved = json.load(f)
        rows = [r for r in saved["rows"] if r["mode"] != "bound"]
        series = {k: v for k, v in saved["series"].items() if k != "bound"}
    modes = a.modes.split(",")
    for seed in [int(s) for s in a.seeds.split(",")]:
        for shares in [m for m in ("equal", "pace") if m in modes] if not a.only_bound else ():
            rec = job(a, seed, shares, os.path.join(a.out, "runs", "%s-%d" % (shares, seed)))
            end = rec.points[-1][0]
            hi, lo = phase_rates(rec.points, a, end)
            rows.append({"seed": seed, "mode": shares, "seconds": end, "high": hi, "low": lo,
                         "mean": rec.points[-1][1] / end, "accuracy": rec.accuracy})
            if shares == "pace":
                rows[-1]["follow"] = follow(rec.shares, a)
            series.setdefault(shares, []).append(rate_series(rec.points))
            print(json.dumps(rows[-1]), flush=True)
        if "bound" not in modes:
            continue
        pace_seconds = [r["seconds"] for r in rows if r["mode"] == "pace" and r["seed"] == seed][0]
        recs = bound(a, seed, os.path.join(a.out, "runs", "bound-%d" % seed), pace_seconds)
        end = min(r.points[-1][0] for r in recs)
        his, los = zip(*(phase_rates(r.points, a, end) for r in recs))
        rows.append({"seed": seed, "mode": "bound", "seconds": end, "high": sum(his), "low": sum(los),
                     "mean": sum(max(s for t, s in r.points if t <= end) for r in recs) / end, "accuracy": None})
        parts = [dict(rate_series(r.points)) for r in recs]
        series.setdefault("bound", []).append(sorted((t, v + parts[1][t]) for t, v in parts[0].items()
                                                     if t in parts[1]))
        print(json.dumps(rows[-1]), flush=True)
    if not a.only_bound and set(modes) != {"equal", "pace", "bound"}:
        return
    order = {"equal": 0, "pace": 1, "bound": 2}
    rows.sort(key=lambda r: (r["seed"], order[r["mode"]]))
    write(a, rows, series)


def write(a, rows, series):
    med = lambda mode, k: statistics.median(r[k] for r in rows if r["mode"] == mode)  # noqa: E731
    rng = lambda mode, k: (min(r[k] for r in rows if r["mode"] == mode),  # noqa: E731
                           max(r[k] for r in rows if r["mode"] == mode))
    lines = ["# A member whose pace changes: shares by pace against equal shares", "",
             "Made by `experiments/changing_pace/run.py --seeds %s --epochs %d --batch %d --low %g --every %g`; "
             "one of 2 workers (MLP, one thread each) held to %g of a core and %g of a core in turns of %g s "
             "(cfs period %d us). Global samples/s (medians over the seeds, ranges); the phases leave out each "
             "phase's first 2 s." % (a.seeds, a.epochs, a.batch, a.low, a.every, a.high, a.low, a.every,
                                     a.period_us), "",
             "| mode | at %g | at %g | whole run | seconds | test accuracy |" % (a.high, a.low),
             "| --- | --- | --- | --- | --- | --- |"]
    for mode in ("equal", "pace", "bound"):
        cells = []
        for k in ("high", "low", "mean", "seconds"):
            lo, hi = rng(mode, k)
            cells.append("%.0f (%.0f–%.0f)" % (med(mode, k), lo, hi))
        acc = [r["accuracy"] for r in rows if r["mode"] == mode and r["accuracy"] is not None]
        cells.append("%.2f %% (%.2f–%.2f)" % (100 * statistics.median(acc), 100 * min(acc), 100 * max(acc))
                     if acc else "—")
        lines.append("| %s | %s |" % (mode, " | ".join(cells)))
    lines += ["", "| ratio | at %g | at %g | whole run |" % (a.high, a.low), "| --- | --- | --- | --- |"]
    for num, den in (("pace", "bound"), ("equal", "bound"), ("pace", "equal")):
        cells = []
        for k in ("high", "low", "mean"):
            rs = [x[k] / y[k] for x, y in zip([r for r in rows if r["mode"] == num],
                                              [r for r in rows if r["mode"] == den])]
            cells.append("%.3f (%.3f–%.3f)" % (statistics.median(rs), min(rs), max(rs)))
        lines.append("| %s / %s | %s |" % (num, den, " | ".join(cells)))
    steps = sorted(x for r in rows if r["mode"] == "pace" for x in r.get("follow", []))
    if steps:
        lines += ["", "Shares by pace follow a switch of the limit (the held member's share covers three quarters "
                  "of its move) in a median of %d steps (%d–%d over %d switches)." %
                  (statistics.median(steps), steps[0], steps[-1], len(steps))]
    lines += ["", "Each run: " + ", ".join("%s seed %d %.1f s" % (r["mode"], r["seed"], r["seconds"]) for r in rows),
              "", "![samples/s against time](rate.png)", ""]
    with open(os.path.join(a.out, "README.md"), "w") as f:
        f.write("\n".join(lines))
    with open(os.path.join(a.out, "rows.json"), "w") as f:
        json.dump({"rows": rows, "series": series}, f)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    fig, ax = plt.subplots(figsize=(9, 4.5))
    colours = {"equal": "tab:red", "pace": "tab:blue", "bound": "tab:gray"}
    for mode, runs in series.items():
        for i, s in enumerate(runs):
            if s:
                t, v = zip(*s)
                ax.plot(t, v, color=colours[mode], alpha=0.8, lw=1.2, label=mode if i == 0 else None)
    top = ax.get_ylim()[1]
    end = max(r["seconds"] for r in rows)
    t = a.every
    while t < end:
        ax.axvspan(t, min(t + a.every, end), color="0.9", zorder=0)
        t += 2 * a.every
    ax.set_ylim(0, top)
    ax.set_xlabel("seconds (shaded: the held member at %g of a core, else %g)" % (a.low, a.high))
    ax.set_ylabel("global samples/s")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(os.path.join(a.out, "rate.png"), dpi=110)


if __name__ == "__main__":
    main()
