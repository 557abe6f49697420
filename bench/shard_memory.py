#!/usr/bin/python3
"""Optimizer-state memory per worker, sharded (optim.shard_state) against
replicated, at 4 workers on this host.

An MLP of three hidden layers of --width (4096: 37M parameters; 2048: 10M)
with AdamW (state: two tensors the size of the model, 296 MB replicated at
width 4096), 4 workers x 1 thread, batch 16 per worker,
--steps steps, no evaluation or periodic checkpoint. Each worker's peak
resident set (VmHWM, which counts the shared-memory pages it touched: its
shard homes and the group's segment) is read from /proc while it runs; the
optimizer state's share of it is the peak minus that of the same job with
plain SGD (no state). Contenders interleaved, --repeats times; prints the
median over workers and repeats, and the sharded state's size against the
replicated one, with the target (1 + copies) / 4.

    bench/shard_memory.py [--limbo build/src/cli/limbo] [--steps 30] [--repeats 3] [--width 4096]
"""
import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def children(pid):
    out = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(p))
        except (OSError, IndexError, ValueError):
            pass
    return out


def hwm(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        return None


def run(limbo, steps, width, extra):
    d = tempfile.mkdtemp(prefix="limbo-shard-mem-")
    args = ["--set", "model.name=mlp", "--set", f"model.width={width}", "--set", "model.depth=3",
            "--set", "data.batch_size=16", "--set", f"train.max_steps={steps}", "--set", "train.threads=1",
            "--set", "train.progress=false", "--set", "train.eval_every_epochs=0",
            "--set", "train.checkpoint_every_epochs=0", "--set", "data.test_limit=200",
            "--set", "elastic.batch_policy=none"] + extra
    p = subprocess.Popen([limbo, "launch", "--nproc", "4", "--min-workers", "4", "--", "--run-dir", d] + args,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    peaks = {}
    while p.poll() is None:
        for c in children(p.pid):
            v = hwm(c)
            if v:
                peaks[c] = max(peaks.get(c, 0), v)
        time.sleep(0.05)
    shutil.rmtree(d, ignore_errors=True)
    if p.returncode:
        raise RuntimeError(f"limbo exited with {p.returncode}")
    return sorted(peaks.values())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limbo", default=os.path.join(ROOT, "build/src/cli/limbo"))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--width", type=int, default=4096, help="the MLP's width (4096: 37M parameters)")
    a = ap.parse_args()
    adamw = ["--set", "optim.algorithm=adamw", "--set", "optim.lr=0.001"]
    runs = {"no state (sgd)": ["--set", "optim.algorithm=sgd", "--set", "optim.momentum=0"],
            "replicated adamw": adamw, "sharded adamw": adamw + ["--set", "optim.shard_state=true"]}
    got = {k: [] for k in runs}
    for rep in range(a.repeats):
        for k, extra in runs.items():
            got[k].append(run(a.limbo, a.steps, a.width, extra))
        print(f"  repeat {rep + 1}: " + "; ".join(f"{k} " + " ".join(f"{v:.0f}" for v in got[k][-1])
                                                 for k in runs) + " (MiB per worker)", flush=True)
    med = {k: statistics.median(v for r in got[k] for v in r) for k in runs}
    print("peak RSS per worker, median over 4 workers x %d repeats (MiB):" % a.repeats)
    for k in runs:
        print(f"  {k:18s} {med[k]:.0f}")
    rep = med["replicated adamw"] - med["no state (sgd)"]
    sh = med["sharded adamw"] - med["no state (sgd)"]
    print(f"  optimizer state per worker: replicated {rep:.0f} MiB, sharded {sh:.0f} MiB: "
          f"{sh / rep:.2f} of replicated (target (1 + copies) / 4 = 0.50 with one copy)")


if __name__ == "__main__":
    main()
