#!/usr/bin/python3
"""Chaos: N jobs, each with one random fault at a random moment; every job
must end well.

Faults (one per job, chosen at random):
  elastic-kill     SIGKILL of a random elastic worker (3 workers, --min-workers 1)
  elastic-stop     SIGSTOP of a random elastic worker (left stopped)
  elastic-term     SIGTERM of a random elastic worker (it leaves cleanly)
  ps-learner-kill  SIGKILL of a random learner (1 shard, 3 learners, softsync)
  ps-shard-kill    SIGKILL of the shard (the launcher restarts it from its checkpoint)
  ps-restart       a learner SIGKILLed and started again by hand with its old --learner-id

Each job must end with exit code 0, write summary.json, and reach an
accuracy within `--tolerance` of the same job without a fault (run first).
Elastic jobs must also use every sample exactly once per epoch: from the
committed global batches (samples-*.txt), and from each member's own slices
(slices-*.txt): two members never trained the same sample in one step, and a
step's slices lie inside its global batch.

    bench/chaos.py [--limbo build/src/cli/limbo] [--jobs 20] [--seed 1]
    bench/chaos.py --each        # one job per fault (what ctest runs)
exit code 0 when every job ended well, 1 otherwise.
"""
import argparse
import glob
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

COMMON = ["--set", "model.name=mlp", "--set", "model.width=64", "--set", "data.train_limit=12000",
          "--set", "data.test_limit=2000", "--set", "data.batch_size=8", "--set", "train.threads=1",
          "--set", "train.progress=false"]
EPOCHS, SAMPLES = 3, 12000
# Steps paced to at least 3 ms (4.5 s of training for 1,500 steps): a fault
# is injected within 2 s of the first step, and over shared memory the
# job's steps take about 2 ms, so an unpaced job could end first.
ELASTIC = COMMON + ["--set", f"train.epochs={EPOCHS}", "--set", "train.sample_log=true",
                    "--set", "elastic.collective_timeout=30", "--set", "train.checkpoint_every_steps=100",
                    "--set", "train.slow_step_ms=3"]
PS = COMMON + ["--set", "train.epochs=5", "--set", "optim.lr=0.02", "--set", "ps.heartbeat_timeout=2",
               "--set", "ps.request_timeout=30", "--set", "ps.checkpoint_every=20"]
FAULTS = ["elastic-kill", "elastic-stop", "elastic-term", "ps-learner-kill", "ps-shard-kill", "ps-restart"]


def wait_for(path, needle, timeout):
    end = time.time() + timeout
    while time.time() < end:
        try:
            with open(path) as f:
                if needle in f.read():
                    return True
        except OSError:
            pass
        time.sleep(0.05)
    return False


def pids_in(log, pattern):
    with open(log) as f:
        return [int(p) for p in re.findall(pattern, f.read())]


def start(limbo, args, log):
    f = open(log, "w")
    return subprocess.Popen([limbo] + args, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def elastic_job(limbo, d, fault, rng):
    run, log = f"{d}/run", f"{d}/launch.log"
    p = start(limbo, ["launch", "--nproc", "3", "--min-workers", "1", "--", "--run-dir", run] + ELASTIC, log)
    note = ""
    if fault:
        if not wait_for(f"{run}/metrics.jsonl", '"kind":"train"', 120):
            return p, run, log, "never started training"
        time.sleep(rng.uniform(0.0, 2.0))
        workers = pids_in(log, r"worker rank \d+ pid (\d+)")
        victim = rng.choice(workers)
        sig = {"elastic-kill": signal.SIGKILL, "elastic-stop": signal.SIGSTOP,
               "elastic-term": signal.SIGTERM}[fault]
        try:
            os.kill(victim, sig)
            note = f"{sig.name} pid {victim}"
        except ProcessLookupError:
            note = f"pid {victim} already gone"
    return p, run, log, note


def ps_job(limbo, d, fault, rng):
    run, log = f"{d}/run", f"{d}/launch.log"
    p = start(limbo, ["launch", "--mode", "async", "--servers", "1", "--workers", "3", "--protocol", "softsync",
                      "--run-dir", run, "--"] + PS, log)
    note = ""
    if fault:
        if not wait_for(log, "joined (lambda = 3", 120):
            return p, run, log, "learners never joined"
        time.sleep(rng.uniform(0.2, 1.2))  # training takes about 2.5 s
        with open(log) as f:
            text = f.read()
        if fault == "ps-shard-kill":
            m = re.findall(r"shard 0 pid (\d+)", text) or [str(x) for x in _children(p.pid, "ps-server")]
            if m:
                os.kill(int(m[-1]), signal.SIGKILL)
                note = f"SIGKILL shard pid {m[-1]}"
        else:
            learners = _children(p.pid, "worker")
            if learners:
                pid, cmd = rng.choice(learners)
                os.kill(pid, signal.SIGKILL)
                note = f"SIGKILL learner pid {pid}"
                if fault == "ps-restart":
                    time.sleep(0.3)
                    again = start(limbo, cmd[1:], f"{d}/restarted.log")
                    note += f", restarted by hand as pid {again.pid}"
                    p.restarted = again
    return p, run, log, note


def _children(ppid, sub):
    """(pid, argv) of the processes whose parent is ppid and whose argv[1] is `sub`."""
    out = []
    for st in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(st) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[1]) != ppid:
                continue
            pid = int(st.split("/")[2])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = [a.decode() for a in f.read().split(b"\0") if a]
            if len(argv) > 1 and argv[1] == sub:
                out.append((pid, argv) if sub == "worker" else pid)
        except (OSError, IndexError, ValueError):
            pass
    return out


def exactly_once(run, epochs, n):
    """Problems with the sample logs, as text ('' when there are none)."""
    steps = {}
    for path in glob.glob(f"{run}/samples-*.txt"):
        for line in open(path):
            v = line.split()
            key = int(v[0])
            if key in steps and steps[key] != v[1:]:
                return f"step {key} differs between members"
            steps[key] = v[1:]
    count = {}
    for v in steps.values():
        e = int(v[0])
        for i in v[1:]:
            count[(e, int(i))] = count.get((e, int(i)), 0) + 1
    if len(count) != epochs * n:
        return f"{epochs * n - len(count)} samples never used"
    dup = sum(1 for c in count.values() if c != 1)
    if dup:
        return f"{dup} samples used more than once"
    # Per member: a step's slices are disjoint and inside its global batch.
    slices = {}
    for path in glob.glob(f"{run}/slices-*.txt"):
        for line in open(path):
            v = line.split()
            slices.setdefault(int(v[0]), []).append([int(x) for x in v[3:]])
    for step, parts in slices.items():
        seen = set()
        batch = set(int(x) for x in steps.get(step, ["0"])[1:])
        for part in parts:
            s = set(part)
            if s & seen:
                return f"step {step}: two members trained the same sample"
            if not s <= batch:
                return f"step {step}: a member trained samples outside the global batch"
            seen |= s
    return ""


def finish(p, timeout):
    try:
        rc = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        rc = "timeout"
    if getattr(p, "restarted", None):
        try:
            p.restarted.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.restarted.kill()
    return rc


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limbo", default="build/src/cli/limbo")
    ap.add_argument("--jobs", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    # Measured spread of ps-restart (a learner killed and restarted with its
    # old id; 5 epochs of softsync): 82.5-85.6 % in 8 jobs alone against a
    # fault-free 85.3 %, and once 80.25 % against 85.35 % while the suite
    # ran beside it. A fault that breaks training ends far lower.
    ap.add_argument("--tolerance", type=float, default=0.08, help="accuracy below the fault-free job allowed")
    ap.add_argument("--faults", default=",".join(FAULTS))
    ap.add_argument("--job-timeout", type=float, default=180, help="seconds before a job counts as hung")
    ap.add_argument("--each", action="store_true", help="one job per fault, in order (the ctest version)")
    a = ap.parse_args()
    limbo = os.path.abspath(a.limbo)
    rng = random.Random(a.seed)
    faults = a.faults.split(",")
    base = {}
    with tempfile.TemporaryDirectory(prefix="limbo-chaos-") as tmp:
        for kind, job in (("elastic", elastic_job), ("ps", ps_job)):
            if not any(f.startswith(kind) for f in faults):
                continue
            d = f"{tmp}/base-{kind}"
            os.makedirs(d)
            p, run, log, _ = job(limbo, d, None, rng)
            rc = finish(p, 600)
            if rc != 0:
                print(f"fault-free {kind} job failed (exit {rc}); see {log}")
                print(open(log).read()[-3000:])
                return 1
            base[kind] = json.load(open(f"{run}/summary.json"))["test_accuracy"]
            print(f"fault-free {kind} job: test accuracy {100 * base[kind]:.2f}%", flush=True)
        good = 0
        t0 = time.time()
        jobs = len(faults) if a.each else a.jobs
        for i in range(jobs):
            fault = faults[i] if a.each else rng.choice(faults)
            kind = "elastic" if fault.startswith("elastic") else "ps"
            d = f"{tmp}/job{i}"
            os.makedirs(d)
            j0 = time.time()
            p, run, log, note = (elastic_job if kind == "elastic" else ps_job)(limbo, d, fault, rng)
            rc = finish(p, a.job_timeout)
            problems = []
            if rc != 0:
                problems.append(f"exit code {rc}")
            acc = None
            if os.path.exists(f"{run}/summary.json"):
                acc = json.load(open(f"{run}/summary.json")).get("test_accuracy")
                if acc is None or acc < base[kind] - a.tolerance:
                    problems.append(f"accuracy {acc} vs fault-free {base[kind]:.4f}")
            else:
                problems.append("no summary.json")
            if kind == "elastic" and not problems:
                why = exactly_once(run, EPOCHS, SAMPLES)
                if why:
                    problems.append(why)
            if fault and (not note or "already gone" in note):
                problems.append("the fault was not injected (the job ended first?)")
            ok = not problems
            good += ok
            print(f"job {i + 1:2d} {fault:16s} {note:45s} exit {rc!s:7s} "
                  f"acc {('%.2f%%' % (100 * acc)) if acc is not None else '-':>7s} "
                  f"{time.time() - j0:5.1f} s  {'ok' if ok else 'FAILED: ' + '; '.join(problems)}", flush=True)
            if not ok:
                keep = f"chaos-failed-job{i}"
                shutil.rmtree(keep, ignore_errors=True)
                shutil.copytree(d, keep, ignore_dangling_symlinks=True)
                print(f"  kept in {keep}/")
        print(f"\n{good} of {jobs} jobs ended well ({time.time() - t0:.0f} s)")
    return 0 if good == jobs else 1


if __name__ == "__main__":
    sys.exit(main())
