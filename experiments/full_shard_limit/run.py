#!/usr/bin/python3
"""A model whose training state one member cannot hold: the same decoder-only
transformer (bench/full_shard_worker.py) trained by 4 members on this host,
each held by a memory cgroup of its own (cgroup v1, root; no swap here), once
replicated (limbo.Job(shard="none")) and once fully sharded (shard="full").

For each mode it prints whether a member was ended by the kernel's OOM
killer, each member's peak usage as its cgroup counted it
(memory.max_usage_in_bytes), and the losses of the steps that committed,
and writes results.md beside this file. A replicated run that the OOM
killer ends is stopped at once (the others would wait for it).

    experiments/full_shard_limit/run.py [--width 1024] [--blocks 12] [--limit-mib 1800] [--steps 6]
"""
import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.join(ROOT, "bench", "full_shard_worker.py")
PY = "/usr/bin/python3"


def read(path, default=""):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return default


def oom_kills(group):
    for line in read(os.path.join(group, "memory.oom_control")).splitlines():
        if line.startswith("oom_kill "):
            return int(line.split()[1])
    return 0


def run(limbo, mode, args):
    groups_file = tempfile.mktemp(prefix="limbo-memgroups-")
    out = tempfile.mkdtemp(prefix="limbo-fsl-out-")
    env = dict(os.environ, MEMORY_LIMIT_MIB=str(args.limit_mib), MEMORY_GROUP_FILE=groups_file,
               FULL_SHARD_OUT=out, PRINT_STEPS="1", LIMBO_PYTHON_DIR=os.path.join(ROOT, "build", "python"))
    env["PYTHONPATH"] = env["LIMBO_PYTHON_DIR"]
    cmd = [limbo, "launch", "--nproc", str(args.members), "--min-workers", str(args.members), "--run-dir",
           tempfile.mkdtemp(prefix="limbo-fsl-"), "--", PY, WORKER, "--mode", mode, "--width", str(args.width),
           "--blocks", str(args.blocks), "--heads", str(args.heads), "--batch", str(args.batch),
           "--steps", str(args.steps), "--context", str(args.context)]
    t0 = time.time()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = []
    killed = 0
    import threading
    reader = threading.Thread(target=lambda: log.extend(p.stdout), daemon=True)
    reader.start()
    while p.poll() is None:
        groups = read(groups_file).split()
        killed = sum(oom_kills(g) for g in groups)
        if killed:  # a member is gone to the OOM killer: the point is made
            p.terminate()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
            break
        time.sleep(0.5)
    p.wait()
    reader.join(timeout=10)
    groups = read(groups_file).split()
    peaks = [int(read(os.path.join(g, "memory.max_usage_in_bytes"), "0") or 0) / (1 << 20) for g in groups]
    killed = max(killed, sum(oom_kills(g) for g in groups))
    for g in groups:  # the members are gone: their groups go too
        for _ in range(20):
            try:
                os.rmdir(g)
                break
            except OSError:
                time.sleep(0.5)
    results = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(out, "rank*.json")))]
    shutil.rmtree(out, ignore_errors=True)
    return {"mode": mode, "exit": p.returncode, "oom_kills": killed, "peaks_mib": peaks, "seconds": time.time() - t0,
            "losses": results[0]["losses"] if results else [], "params": results[0]["params"] if results else None,
            "log": "".join(log)[-1500:]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limbo", default=os.path.join(ROOT, "build", "src", "cli", "limbo"))
    ap.add_argument("--members", type=int, default=4)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--context", type=int, default=32)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--limit-mib", type=float, default=1800)
    ap.add_argument("--modes", default="none,full")
    args = ap.parse_args()
    if os.geteuid() != 0 or not os.access("/sys/fs/cgroup/memory", os.W_OK):
        sys.exit("full_shard_limit: needs root and the cgroup v1 memory controller")
    rows = []
    for mode in args.modes.split(","):
        r = run(args.limbo, mode, args)
        rows.append(r)
        print("%-5s exit %s, OOM kills %d, peaks %s MiB, %d steps committed, losses %s (%.0f s)" %
              (mode, r["exit"], r["oom_kills"], " ".join("%.0f" % x for x in r["peaks_mib"]), len(r["losses"]),
               " ".join("%.3f" % x for x in r["losses"]), r["seconds"]), flush=True)
        if r["exit"] != 0 and not r["oom_kills"]:
            print(r["log"])
    params = next((r["params"] for r in rows if r["params"]), None)
    with open(os.path.join(HERE, "results.md"), "w") as f:
        f.write("# A model whose training state one member cannot hold\n\n")
        f.write("`experiments/full_shard_limit/run.py --width %d --blocks %d --limit-mib %.0f --steps %d`: "
                "%d members on one host, each in a memory cgroup of %.0f MiB; %s parameters, so the replicated "
                "training state (weights, gradient, AdamW's moments: 16 bytes a parameter) is %s MiB, %s the "
                "limit.\n\n" % (args.width, args.blocks, args.limit_mib, args.steps, args.members, args.limit_mib,
                                "%.1fM" % (params / 1e6) if params else "?",
                                "%.0f" % (16 * params / (1 << 20)) if params else "?",
                                "%.2fx" % (16 * params / (1 << 20) / args.limit_mib) if params else "?"))
        f.write("| mode | ended by the OOM killer | peak per member (cgroup) | steps committed | losses |\n")
        f.write("| --- | --- | --- | --- | --- |\n")
        for r in rows:
            f.write("| %s | %s | %s MiB | %d | %s |\n" % (
                r["mode"], "yes (%d)" % r["oom_kills"] if r["oom_kills"] else "no",
                " / ".join("%.0f" % x for x in r["peaks_mib"]), len(r["losses"]),
                " ".join("%.3f" % x for x in r["losses"])))


if __name__ == "__main__":
    main()
