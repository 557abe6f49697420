#!/usr/bin/python3
"""Peak memory per member of fully sharded training (limbo.Job(shard="full"))
against the replicated path, sharded optimizer state (shard="state") and
PyTorch's DDP + ZeroRedundancyOptimizer, all at 4 members on this host.

The model is bench/full_shard_worker.py's decoder-only transformer
(--width, --blocks), AdamW, batch --batch a member, --steps steps. Each
member reports its peak resident set over the steps after the second,
less its resident set before the model was built (the interpreter, torch
and Limbo); shared-memory pages it touched count (its shard homes, the
group's segment). The formula is the target of docs/sharded_state.md:

    (weights + gradient + AdamW's two moments) x 2 / N + the largest unit's
    weights + activations

with 16 bytes a parameter for the first term, and the activations taken as
what the replicated path holds beyond its 16 bytes a parameter. Contenders
interleaved, --repeats times; medians over members and repeats.

With --hosts, 2 hosts x 2 members (two network namespaces joined by a
veth pair; root): the fully sharded members then also keep copies of the
other host's shards.

    bench/full_shard_memory.py [--limbo build/src/cli/limbo] [--repeats 2] [--width 512] [--blocks 8] [--hosts]
"""
import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from limbo_run import Veth  # noqa: E402

VETH = None  # --hosts: 2 namespaces, nproc / 2 members each
WORKER = os.path.join(ROOT, "bench", "full_shard_worker.py")
PY = "/usr/bin/python3"


def run(limbo, mode, nproc, extra):
    env = dict(os.environ)
    env["LIMBO_PYTHON_DIR"] = os.path.join(ROOT, "build", "python")
    env["PYTHONPATH"] = env["LIMBO_PYTHON_DIR"]
    if mode == "zero1":
        # The heap settings `limbo launch` gives its workers, so that the peer
        # runs as the members do.
        env.update(MALLOC_MMAP_THRESHOLD_=str(64 << 20), MALLOC_TRIM_THRESHOLD_=str(512 << 20))
        env["FULL_SHARD_OUT"] = tempfile.mkdtemp(prefix="limbo-fsm-out-")
        port = random.randint(20000, 40000)
        # The ranks started here, as torchrun would (its launcher fails under
        # this Python 3.11).
        per = nproc // 2 if VETH else nproc
        procs = []
        for r in range(nproc):
            e = dict(env, MASTER_ADDR=VETH.ip[0] if VETH else "127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                     WORLD_SIZE=str(nproc), LOCAL_RANK=str(r % per))
            if VETH:
                e["GLOO_SOCKET_IFNAME"] = VETH.dev[r // per]
            procs.append(subprocess.Popen((VETH.prefix(r // per) if VETH else []) + [PY, WORKER, "--mode", mode] +
                                          extra, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=e))
        logs = [p.communicate(timeout=1800)[0] for p in procs]
        if any(p.returncode != 0 for p in procs):
            sys.exit("%s failed:\n%s" % (mode, "".join(logs)[-3000:]))
        d = env["FULL_SHARD_OUT"]
        out = [json.load(open(os.path.join(d, f))) for f in sorted(os.listdir(d))]
        shutil.rmtree(d, ignore_errors=True)
        return out
    env["FULL_SHARD_OUT"] = tempfile.mkdtemp(prefix="limbo-fsm-out-")
    run_dir = tempfile.mkdtemp(prefix="limbo-fsm-")
    after = ["--", PY, WORKER, "--mode", mode] + extra
    if VETH:
        rdzv = "%s:%d" % (VETH.ip[0], random.randint(29000, 29900))
        procs = []
        for h in range(2):
            procs.append(subprocess.Popen(VETH.prefix(h) + [limbo, "launch", "--nproc", str(nproc // 2),
                                                              "--min-workers", str(nproc), "--rdzv", rdzv,
                                                              "--run-dir", run_dir] + after,
                                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        logs = [p.communicate(timeout=1800)[0] for p in procs]
        if any(p.returncode != 0 for p in procs):
            sys.exit("%s failed:\n%s" % (mode, "".join(logs)[-3000:]))
    else:
        r = subprocess.run([limbo, "launch", "--nproc", str(nproc), "--run-dir", run_dir] + after, env=env,
                           capture_output=True, text=True, timeout=1800)
        if r.returncode != 0:
            sys.exit("%s failed:\n%s" % (mode, (r.stdout + r.stderr)[-3000:]))
    out = [json.load(open(os.path.join(env["FULL_SHARD_OUT"], f))) for f in sorted(os.listdir(env["FULL_SHARD_OUT"]))]
    # (a run's checkpoint is its state's size: rounds would fill the disk)
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(env["FULL_SHARD_OUT"], ignore_errors=True)
    if len(out) != nproc:
        sys.exit("%s: %d of %d members reported:\n%s" % (mode, len(out), nproc, r.stdout[-2000:]))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limbo", default=os.path.join(ROOT, "build", "src", "cli", "limbo"))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--modes", default="none,state,full,zero1")
    ap.add_argument("--hosts", action="store_true", help="2 hosts (network namespaces) of nproc / 2 members")
    args = ap.parse_args()
    global VETH
    if args.hosts:
        VETH = Veth()
    try:
        measure(args)
    finally:
        if VETH:
            VETH.close()


def measure(args):
    extra = ["--width", str(args.width), "--blocks", str(args.blocks), "--batch", str(args.batch),
             "--steps", str(args.steps)]
    modes = args.modes.split(",")
    peaks = {m: [] for m in modes}
    rates = {m: [] for m in modes}
    info = None
    for rep in range(args.repeats):
        for m in modes:  # interleaved
            out = run(args.limbo, m, args.nproc, extra)
            info = out[0]
            peaks[m] += [x["peak_mib"] - x["base_mib"] for x in out]
            rates[m].append(out[0]["samples_per_second"])
            print("  round %d %-6s peak above base (MiB) %s, %.2f samples/s" %
                  (rep + 1, m, " ".join("%.0f" % (x["peak_mib"] - x["base_mib"]) for x in out),
                   out[0]["samples_per_second"]), flush=True)
    params, unit, n = info["params"], info["unit_params"], args.nproc
    mib = 1 << 20
    state16 = 16 * params / mib
    print("\n%d members%s, %.1fM parameters (largest unit %.2fM); weights + gradient + AdamW state: %.0f MiB"
          % (n, " on 2 hosts" if VETH else "", params / 1e6, unit / 1e6, state16))
    med = {m: statistics.median(peaks[m]) for m in modes}
    act = med["none"] - state16 if "none" in med else float("nan")
    formula = state16 * 2 / n + 4 * unit / mib + act
    print("activations (replicated peak less 16 bytes a parameter): %.0f MiB" % act)
    print("formula: %.0f x 2/%d + %.0f (unit) + %.0f (activations) = %.0f MiB\n"
          % (state16, n, 4 * unit / mib, act, formula))
    print("%-8s %18s %14s %12s %16s" % ("mode", "peak above base", "range", "/ formula", "samples/s"))
    for m in modes:
        print("%-8s %14.0f MiB %7.0f-%-6.0f %11.2fx %10.2f (%.2f-%.2f)" %
              (m, med[m], min(peaks[m]), max(peaks[m]), med[m] / formula, statistics.median(rates[m]),
               min(rates[m]), max(rates[m])))


if __name__ == "__main__":
    main()
