#!/usr/bin/python3
"""Elastic recovery time: SIGKILL one of 3 workers mid-epoch, and start a new
worker by hand into a running job; report the median time from the event to
the survivors' next completed step, split into its parts, over several trials.

    bench/recovery.py [--limbo build/src/cli/limbo] [--trials 5]

Parts (from the membership records in metrics.jsonl): detection (the failed
step's collective until it raised), rendezvous (asking for and receiving the
next round), group (forming the new Gloo group), sync (state broadcast from
the newest member), first step (until the next step completed). For a join,
"from the event" starts when the new worker process is started.
For comparison: torchrun restarts every worker on a membership change and,
by default, waits tens of seconds for the rendezvous to settle.
"""
import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import tempfile
import time


def train_args(run_dir):
    return ["--run-dir", run_dir, "--set", "model.name=lenet", "--set", "data.train_limit=20000",
            "--set", "data.test_limit=500", "--set", "data.batch_size=32", "--set", "train.epochs=30",
            "--set", "train.threads=1", "--set", "train.progress=false",
            "--set", "train.checkpoint_every_epochs=0", "--set", "train.eval_every_epochs=0"]


def wait_for(path, needle, timeout):
    end = time.time() + timeout
    while time.time() < end:
        if os.path.exists(path) and needle in open(path).read():
            return True
        time.sleep(0.05)
    return False


def membership_records(run_dir):
    out = []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if r.get("kind") == "membership" and r.get("reason") != "start":
                out.append(r)
    return out


def trial(limbo, kind):
    d = tempfile.mkdtemp(prefix="limbo-recovery-")
    run = os.path.join(d, "run")
    log = open(os.path.join(d, "launch.log"), "w")
    nproc = 3 if kind == "kill" else 2
    launcher = subprocess.Popen([limbo, "launch", "--nproc", str(nproc), "--min-workers", "1", "--"]
                                + train_args(run), stdout=log, stderr=subprocess.STDOUT)
    try:
        if not wait_for(os.path.join(run, "metrics.jsonl"), '"kind":"train"', 60):
            raise RuntimeError("training did not start")
        time.sleep(1.0)
        text = open(log.name).read()
        if kind == "kill":
            pid = int(re.search(r"worker rank 1 pid (\d+)", text).group(1))
            t0 = time.time()
            os.kill(pid, signal.SIGKILL)
        else:
            rdzv = re.search(r"store at ([0-9.]+:\d+)", text).group(1)
            t0 = time.time()
            joiner = subprocess.Popen([limbo, "train", "--elastic", "--dist-rdzv", rdzv]
                                      + train_args(run), stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL)
        # The record is written at the first completed step after the change.
        end = time.time() + 60
        recs = []
        while not recs and time.time() < end:
            time.sleep(0.05)
            recs = membership_records(run)
        if not recs:
            raise RuntimeError("no recovery recorded")
        rec = recs[0]
        rec["wall_from_event"] = None
        if kind == "join":
            # From starting the process to the first step with it: includes
            # process start, libtorch load and dataset load of the joiner.
            mtime = os.path.getmtime(os.path.join(run, "metrics.jsonl"))
            rec["wall_from_event"] = mtime - t0
        return rec
    finally:
        launcher.send_signal(signal.SIGTERM)
        if kind == "join":
            joiner.send_signal(signal.SIGTERM)
            joiner.wait()
        launcher.wait()
        log.close()
        shutil.rmtree(d, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limbo", default="build/src/cli/limbo")
    ap.add_argument("--trials", type=int, default=5)
    args = ap.parse_args()
    parts = ["detection_seconds", "rendezvous_seconds", "group_seconds", "sync_seconds",
             "first_step_seconds"]
    for kind in ("kill", "join"):
        recs = [trial(args.limbo, kind) for _ in range(args.trials)]
        med = {p: statistics.median(r[p] for r in recs) for p in parts}
        print(f"{kind}: median over {len(recs)} trials (s): " +
              ", ".join(f"{p.replace('_seconds', '')} {med[p]:.3f}" for p in parts))
        if kind == "kill":
            print(f"  kill -> next completed step (first_step, includes the parts before it): "
                  f"median {med['first_step_seconds']:.3f} s, max "
                  f"{max(r['first_step_seconds'] for r in recs):.3f} s (target <= 3 s)")
        else:
            walls = [r["wall_from_event"] for r in recs]
            print(f"  members agree -> first step with the new worker: median "
                  f"{med['first_step_seconds']:.3f} s; process start -> that step: median "
                  f"{statistics.median(walls):.2f} s (target <= 3 s)")


if __name__ == "__main__":
    main()
