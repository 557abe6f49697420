#!/usr/bin/python3
"""A model whose training state one member cannot hold: a decoder-only
transformer (bench/full_shard_worker.py, learnable tokens: the loss falls)
trained by 4 members on this host, each held by a memory cgroup of its own
(cgroup v1, root; no swap here) whose limit is at most half the replicated
training state (weights, gradient and AdamW's two moments: 16 bytes a
parameter), once replicated (limbo.Job(shard="none")) and once fully
sharded (shard="full").

With --kill-at-step K the fully sharded run loses a member to SIGKILL after
step K, and the launcher (--elastic-schedule 0:4) starts another that joins
the job (in a cgroup of the same limit). Every committed step's global batch
is logged; no sample may be used twice.

For each mode it prints whether a member was ended by the kernel's OOM
killer, each member's peak usage as its cgroup counted it
(memory.max_usage_in_bytes), each member's peak resident set over the
training steps (VmHWM after step 2), the losses of the steps that
committed, and writes results.md beside this file. A replicated run that
the OOM killer ends is stopped at once (the others would wait for it).

    experiments/full_shard_limit/run.py [--width 1024] [--blocks 20] [--limit-mib 1900] [--steps 16] [--kill-at-step 5]
"""
import argparse
import glob
import json
import os
import random
import shutil
import subprocess
import sys
import signal
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.join(ROOT, "bench", "full_shard_worker.py")
PY = "/usr/bin/python3"
sys.path.insert(0, os.path.join(ROOT, "bench"))
from limbo_run import Veth  # noqa: E402

VETH = None  # --hosts: 2 namespaces, --members / 2 each


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


def run(limbo, mode, args, steps=None, run_dirs=None, resume=False, keep=False, kill=True):
    steps = steps or args.steps
    groups_file = tempfile.mktemp(prefix="limbo-memgroups-")
    out = tempfile.mkdtemp(prefix="limbo-fsl-out-")
    env = dict(os.environ, MEMORY_LIMIT_MIB=str(args.limit_mib), MEMORY_GROUP_FILE=groups_file,
               FULL_SHARD_OUT=out, SAMPLES_DIR=out, PRINT_STEPS="1",
               LIMBO_PYTHON_DIR=os.path.join(ROOT, "build", "python"))
    env["PYTHONPATH"] = env["LIMBO_PYTHON_DIR"]
    elastic = mode == "full" and args.kill_at_step > 0 and kill
    hosts = 2 if args.hosts else 1
    per = args.members // hosts
    shape = ["--min-workers", "2", "--max-workers", str(args.members), "--start-workers", str(args.members),
             "--elastic-schedule", "0:%d" % per] if elastic else ["--min-workers", str(args.members)]
    after = ["--", PY, WORKER, "--mode", mode, "--width", str(args.width), "--pattern", "--lr", str(args.lr),
             "--blocks", str(args.blocks), "--heads", str(args.heads), "--batch", str(args.batch),
             "--steps", str(steps), "--data-steps", str(args.steps), "--context", str(args.context)]
    rdzv = ["--rdzv", "%s:%d" % (VETH.ip[0], random.randint(29000, 29900))] if VETH else []
    t0 = time.time()
    procs = []
    run_dirs = run_dirs or [tempfile.mkdtemp(prefix="limbo-fsl-") for _ in range(hosts)]
    for h in range(hosts):  # a launcher a host (a network namespace), a run directory each
        cmd = [limbo, "launch", "--nproc", str(per)] + rdzv + shape + \
            ["--run-dir", run_dirs[h]] + (["--resume"] if resume else []) + after
        # nsenter: the host's network only (`ip netns exec` mounts a sysfs
        # of its own, without the cgroup controllers the members join).
        prefix = ["nsenter", "--net=/run/netns/" + VETH.ns[h]] if VETH else []
        procs.append(subprocess.Popen(prefix + cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    log = []
    killed = 0
    victim = None
    where = {}
    highest = {}  # each group's peak (with --trace the kernel's is reset every poll)
    trace = open(args.trace, "w") if args.trace else None
    readers = [threading.Thread(target=lambda p=p: log.extend(p.stdout), daemon=True) for p in procs]
    for r in readers:
        r.start()
    while any(p.poll() is None for p in procs):
        groups = read(groups_file).split()
        killed = sum(oom_kills(g) for g in groups)
        if killed:  # a member is gone to the OOM killer: the point is made
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
            break
        for g in groups:  # where each member's usage peaked: the output line just before
            try:
                use = int(read(os.path.join(g, "memory.usage_in_bytes"), "0") or 0) / (1 << 20)
            except ValueError:
                use = 0
            if trace:  # the peak since the last poll, then a fresh count
                try:
                    peak = int(read(os.path.join(g, "memory.max_usage_in_bytes"), "0") or 0) / (1 << 20)
                    with open(os.path.join(g, "memory.max_usage_in_bytes"), "w") as f:
                        f.write("0")
                except (OSError, ValueError):
                    peak = use
                highest[g] = max(highest.get(g, 0), peak)
                use = max(use, peak)
                trace.write("%.2f %s %.0f %s\n" % (time.time() - t0, os.path.basename(g), peak,
                                                     log[-1].strip() if log else ""))
            if use > where.get(g, (0, ""))[0]:
                where[g] = (use, log[-1].strip() if log else "")
        if elastic and victim is None and any(l.startswith("step %d loss" % args.kill_at_step) for l in list(log)):
            # SIGKILL the member in the second cgroup (rank order of their start).
            pids = read(os.path.join(groups[1], "cgroup.procs")).split() if len(groups) > 1 else []
            if pids:
                victim = int(pids[0])
                os.kill(victim, signal.SIGKILL)
                print("  killed member pid %d after step %d" % (victim, args.kill_at_step), flush=True)
        time.sleep(0.05 if trace else 0.2)
    for p, r in zip(procs, readers):
        p.wait()
        r.join(timeout=10)
    exit_code = max((p.returncode for p in procs), key=abs)
    groups = read(groups_file).split()
    peaks = [max(highest.get(g, 0), int(read(os.path.join(g, "memory.max_usage_in_bytes"), "0") or 0) / (1 << 20))
             for g in groups]
    killed = max(killed, sum(oom_kills(g) for g in groups))
    for g in groups:  # the members are gone: their groups go too
        for _ in range(20):
            try:
                os.rmdir(g)
                break
            except OSError:
                time.sleep(0.5)
    results = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(out, "rank*.json")))]
    # Every committed step's global batch, from every member's log: the
    # same batch wherever a step was logged, no sample twice.
    steps = {}
    consistent = True
    for path in glob.glob(os.path.join(out, "samples-*.txt")):
        for line in open(path):
            if not line.endswith("\n"):
                continue
            f = line.split()
            ids = tuple(map(int, f[1:]))
            consistent = consistent and steps.setdefault(int(f[0]), ids) == ids
    used = [i for ids in steps.values() for i in ids]
    first_step = min(steps) if steps else 1  # (a resumed run's first is the checkpoint's next)
    once = consistent and len(used) == len(set(used)) and \
        sorted(steps) == list(range(first_step, first_step + len(steps)))
    rounds = {}  # round number: its line (every launcher prints it)
    for l in log:
        if "launch: membership round" in l:
            rounds[int(l.split("membership round")[1].split(":")[0])] = l
    joins = sum(1 for n, l in rounds.items() if n > 1 and "joined" in l)  # after the first round's
    with open(os.path.join(HERE, "last-%s.log" % mode), "w") as f:  # the launcher's and members' output
        f.write("".join(log))
        for g, (use, line) in where.items():
            f.write("peak of %s: %.0f MiB after: %s\n" % (g, use, line))
    shutil.rmtree(out, ignore_errors=True)
    for d in run_dirs if not keep else []:  # (checkpoints of the model's whole state: runs would fill the disk)
        shutil.rmtree(d, ignore_errors=True)
    losses = max((r["losses"] for r in results), key=len) if results else []
    return {"mode": mode, "exit": exit_code, "oom_kills": killed, "peaks_mib": peaks, "seconds": time.time() - t0,
            "losses": losses, "params": results[0]["params"] if results else None,
            "unit_params": results[0]["unit_params"] if results else None,
            "hwm_mib": [r["peak_mib"] for r in results if r["peak_mib"] == r["peak_mib"]], "steps": len(steps), "once": once,
            "victim": victim, "joins": joins, "log": "".join(log)[-3000:], "run_dirs": run_dirs,
            "resumed": resume}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limbo", default=os.path.join(ROOT, "build", "src", "cli", "limbo"))
    ap.add_argument("--members", type=int, default=4)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=20)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--context", type=int, default=32)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--kill-at-step", type=int, default=5, help="0: no member lost")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--limit-mib", type=float, default=1900)
    ap.add_argument("--modes", default="none,full")
    ap.add_argument("--hosts", action="store_true", help="2 hosts (network namespaces, root) of --members / 2 each")
    ap.add_argument("--trace", help="write each member's peak memory every 50 ms, with the output's last line, here")
    ap.add_argument("--resume-at", type=int, default=0,
                    help="the fully sharded job stops after this many steps (its checkpoint a shard a member), "
                         "and is resumed to --steps under the same limit (no member lost)")
    args = ap.parse_args()
    if os.geteuid() != 0 or not os.access("/sys/fs/cgroup/memory", os.W_OK):
        sys.exit("full_shard_limit: needs root and the cgroup v1 memory controller")
    global VETH
    if args.hosts:
        VETH = Veth()
    try:
        rows = measure(args)
    finally:
        if VETH:
            VETH.close()
    write_results(args, rows)


def measure(args):
    rows = []
    for mode in args.modes.split(","):
        runs = [run(args.limbo, mode, args)] if not (args.resume_at and mode == "full") else []
        if not runs:  # stopped after --resume-at steps, resumed from its checkpoint to --steps
            first = run(args.limbo, mode, args, steps=args.resume_at, keep=True, kill=False)
            runs.append(first)
            if first["exit"] == 0:
                runs.append(run(args.limbo, mode, args, run_dirs=first["run_dirs"], resume=True, kill=False))
            for d in first["run_dirs"]:
                shutil.rmtree(d, ignore_errors=True)
            # The same steps uninterrupted: the resumed run's losses are its last ones.
            whole = run(args.limbo, mode, args, kill=False)
            runs.append(whole)
            if len(runs) == 3:
                same = runs[1]["losses"] == whole["losses"][len(first["losses"]):]
                print("the resumed run's losses are the uninterrupted run's last %d: %s" %
                      (len(runs[1]["losses"]), same), flush=True)
                runs[1]["same_as_uninterrupted"] = same
        for r in runs:
            report(args, mode, r)
        rows.extend(runs)
    return rows


def report(args, mode, r):
    print("%-5s%s exit %s, OOM kills %d, cgroup peaks %s MiB, VmHWM %s MiB, %d steps committed%s, "
          "every sample at most once: %s, losses %s (%.0f s)" %
          (mode, " (resumed)" if r["resumed"] else "", r["exit"], r["oom_kills"], " ".join("%.0f" % x for x in r["peaks_mib"]),
           " ".join("%.0f" % x for x in r["hwm_mib"]), r["steps"],
           (", member pid %d SIGKILLed after step %d, %d joined" % (r["victim"], args.kill_at_step, r["joins"])
            if r["victim"] else ""), r["once"], " ".join("%.3f" % x for x in r["losses"]), r["seconds"]),
          flush=True)
    if r["exit"] != 0 and not r["oom_kills"]:
        print(r["log"])


def write_results(args, rows):
    params = next((r["params"] for r in rows if r["params"]), None)
    unit = next((r["unit_params"] for r in rows if r["unit_params"]), None)
    mib = 1 << 20
    name = "results-hosts" if args.hosts else "results"
    with open(os.path.join(HERE, name + ("-resume" if args.resume_at else "") + ".md"), "w") as f:
        f.write("# A model whose training state one member cannot hold\n\n")
        f.write("`experiments/full_shard_limit/run.py --width %d --blocks %d --limit-mib %.0f --steps %d "
                "--kill-at-step %d%s%s`: %d members %s, each in a memory cgroup of %.0f MiB (no swap); "
                "%s parameters, so the replicated training state (weights, gradient, AdamW's moments: 16 bytes a "
                "parameter) is %s MiB, %s the limit.\n\n" % (
                    args.width, args.blocks, args.limit_mib, args.steps, 0 if args.resume_at else args.kill_at_step,
                    " --hosts" if args.hosts else "", " --resume-at %d" % args.resume_at if args.resume_at else "",
                    args.members,
                    "on 2 hosts (network namespaces) of %d" % (args.members // 2) if args.hosts else "on one host",
                    args.limit_mib, "%.1fM" % (params / 1e6) if params else "?",
                    "%.0f" % (16 * params / mib) if params else "?",
                    "%.2fx" % (16 * params / mib / args.limit_mib) if params else "?"))
        if params and unit:
            f.write("The formula's state term, 16 bytes a parameter x 2 / %d, is %.0f MiB; one unit's weights "
                    "(a block, %.1fM parameters) %.0f MiB.\n\n" % (args.members, 16 * params * 2 / args.members / mib,
                                                                  unit / 1e6, 4 * unit / mib))
        f.write("| mode | ended by the OOM killer | peak per member (cgroup) | peak resident set over the steps "
                "(VmHWM after step 2) | steps committed | a member SIGKILLed, one joined | every sample at most "
                "once | losses |\n")
        f.write("| --- | --- | --- | --- | --- | --- | --- | --- |\n")
        for r in rows:
            f.write("| %s | %s | %s MiB | %s MiB | %d | %s | %s | %s |\n" % (
                r["mode"] + (", resumed from its checkpoint" if r["resumed"] else "") +
                ("" if r.get("same_as_uninterrupted") is None else
                 " (losses the uninterrupted run's: %s)" % ("yes" if r["same_as_uninterrupted"] else "NO")), "yes (%d)" % r["oom_kills"] if r["oom_kills"] else "no",
                " / ".join("%.0f" % x for x in r["peaks_mib"]), " / ".join("%.0f" % x for x in r["hwm_mib"]) or "-",
                r["steps"], "after step %d; %d joined" % (args.kill_at_step, r["joins"]) if r["victim"] else "no",
                "yes" if r["once"] else "NO", " ".join("%.3f" % x for x in r["losses"])))
        f.write("\nA cgroup's count includes page cache (the libraries, the checkpoint's files), which the kernel "
                "takes back at the limit: a peak at the limit is not a kill; the OOM killer's kills are the second "
                "column. The resident set counts the shared memory a member maps: a member that finishes a dead "
                "member's home from its log maps pages the dead member's cgroup holds.\n")


if __name__ == "__main__":
    main()
