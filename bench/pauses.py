#!/usr/bin/python3
"""The cost of a pause: a process stopped (SIGSTOP) for D seconds and let go
again (SIGCONT), as steal time, a live migration, a swap storm or an
attached debugger do, while 3 workers train (elastic, one host).

Two targets:
  coordinator  the launcher that holds the store and the coordinator
  worker       one worker (its heartbeats stop: past the heartbeat
               timeout, 0.4 s, the coordinator drops it, and it joins again)

For each target and each pause length, `--repeats` jobs with one pause
each, interleaved with jobs without a pause (the baseline). Printed per
row: the exit codes, membership rounds beyond the first, formations that
failed, the membership changes the summary counts, and the wall time over
the baseline's (medians, with the range).

    bench/pauses.py [--limbo build/src/cli/limbo] [--pauses 0.2 0.6 1.5 3] [--repeats 3]
"""
import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import tempfile
import time

from chaos import wait_for  # (bench/chaos.py: a file's text waited for)

TRAIN = ["--set", "model.name=mlp", "--set", "model.width=64", "--set", "data.train_limit=3000",
         "--set", "data.test_limit=300", "--set", "data.batch_size=8", "--set", "train.epochs=4",
         "--set", "train.threads=1", "--set", "train.progress=false", "--set", "elastic.collective_timeout=10",
         # paced (10 ms a step, 500 steps): training lasts well past a 3 s pause
         "--set", "train.slow_step_ms=10"]


def job(limbo, target, pause):
    with tempfile.TemporaryDirectory(prefix="limbo-pause-") as d:
        run, log = f"{d}/run", f"{d}/launch.log"
        t0 = time.time()
        with open(log, "w") as f:
            p = subprocess.Popen([limbo, "launch", "--nproc", "3", "--min-workers", "1", "--", "--run-dir", run] + TRAIN,
                                 stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        if pause > 0:
            if not wait_for(f"{run}/metrics.jsonl", '"kind":"train"', 120):
                p.kill()
                raise SystemExit("the job never started training:\n" + open(log).read())
            time.sleep(0.5)
            if target == "coordinator":
                victim = p.pid
            else:
                victim = int(re.findall(r"worker rank 1 pid (\d+)", open(log).read())[0])
            os.kill(victim, signal.SIGSTOP)
            time.sleep(pause)
            os.kill(victim, signal.SIGCONT)
        code = p.wait(timeout=600)
        wall = time.time() - t0
        text = open(log).read()
        try:
            s = json.load(open(f"{run}/summary.json"))
        except OSError:
            s = {}
        return {"code": code, "wall": wall, "rounds": len(re.findall(r"launch: membership round \d+", text)) - 1,
                "failed": len(re.findall(r"failed to form", text)), "changes": s.get("membership_changes", -1),
                "cut_off": len(re.findall(r"out of its round", text))}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limbo", default=os.path.join(os.path.dirname(__file__), "..", "build", "src", "cli", "limbo"))
    ap.add_argument("--pauses", type=float, nargs="+", default=[0.2, 0.6, 1.5, 3.0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--targets", nargs="+", default=["coordinator", "worker"])
    a = ap.parse_args()
    base, rows = [], {}
    for r in range(a.repeats):
        for target in a.targets:
            for pause in a.pauses:
                base.append(job(a.limbo, None, 0.0)["wall"])
                rows.setdefault((target, pause), []).append(job(a.limbo, target, pause))
                print(f"  repeat {r + 1}: {target} paused {pause} s: {rows[(target, pause)][-1]}", flush=True)
    b = statistics.median(base)
    print(f"\nbaseline (no pause): wall {b:.2f} s (median of {len(base)}, {min(base):.2f}-{max(base):.2f})")
    print("| paused | for | exit codes | extra rounds | failed formations | membership changes | "
          "members cut off | wall over the baseline (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for (target, pause), js in rows.items():
        med = lambda k: statistics.median(j[k] for j in js)
        over = [j["wall"] - b for j in js]
        print(f"| {target} | {pause} s | {','.join(str(j['code']) for j in js)} | {med('rounds'):g} | "
              f"{med('failed'):g} | {med('changes'):g} | {med('cut_off'):g} | "
              f"{statistics.median(over):+.2f} ({min(over):+.2f} to {max(over):+.2f}) |")


if __name__ == "__main__":
    main()
