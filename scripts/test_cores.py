#!/usr/bin/env python3
"""Runs ctest and measures how many cores each test keeps busy on average
(CPU seconds of its process tree over its wall seconds), then writes them to
tests/ctest_cores.txt, which the build turns into each test's PROCESSORS
(tests/cores.cmake): a test that mostly waits (on a timeout, a heartbeat, a
host that is gone) takes half a slot, so another runs beside it.

    cd build && ../scripts/test_cores.py [ctest options, e.g. -j4 -R Elastic]

A test's CPU is its process tree's, sampled every 0.5 s: the root's own and
reaped children's time plus every live descendant's. Processes that leave the
tree (a daemon that forks away) are not counted. Tests this run did not see
keep their previous figure."""
import json
import os
import re
import subprocess
import sys
import threading
import time

HZ = os.sysconf("SC_CLK_TCK")
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "ctest_cores.txt")


def stat(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            rest = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(rest[1]), int(rest[11]) + int(rest[12]), int(rest[13]) + int(rest[14])


def cmdline(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return tuple(a.decode(errors="replace") for a in f.read().split(b"\0") if a)
    except OSError:
        return ()


def test_commands():
    """Command line (as run) -> test name, for every test ctest knows."""
    out = subprocess.run(["ctest", "--show-only=json-v1"], check=True, capture_output=True, text=True).stdout
    return {tuple(t.get("command", [])): t["name"] for t in json.loads(out)["tests"]}


def track(ctest_pid, names, cpu):
    while True:
        procs = {}
        for p in os.listdir("/proc"):
            if p.isdigit():
                s = stat(int(p))
                if s:
                    procs[int(p)] = s
        if ctest_pid not in procs:
            return
        kids = {}
        for p, (pp, _, _) in procs.items():
            kids.setdefault(pp, []).append(p)
        for root in kids.get(ctest_pid, []):
            name = names.get(cmdline(root))
            if name is None:
                continue
            total, stack = procs[root][2], [root]
            while stack:
                q = stack.pop()
                total += procs[q][1]
                stack += kids.get(q, [])
            cpu[name] = max(cpu.get(name, 0.0), total / HZ)
        time.sleep(0.5)


def slots(cores):
    """ctest slots, two a core: up to 0.6 of a core one slot (it mostly waits),
    more two. Never more than two, even for a test that keeps more than a
    core busy: ctest starts whatever fits in the free slots, so a test that
    needs three would wait behind the others to the end of the run and then
    run nearly alone (measured: 300 s of the run's end)."""
    return 1 if cores <= 0.6 else 2


def main():
    names = test_commands()
    cpu = {}
    ctest = subprocess.Popen(["ctest"] + sys.argv[1:], stdout=subprocess.PIPE, text=True)
    t = threading.Thread(target=track, args=(ctest.pid, names, cpu), daemon=True)
    t.start()
    wall = {}
    for line in ctest.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        m = re.search(r"Test +#\d+: (\S+) \.+.*?(Passed|Failed|Not Run|Skipped)?\s+([\d.]+) sec", line)
        if m:
            wall[m.group(1)] = float(m.group(3))
    rc = ctest.wait()
    t.join(timeout=5)
    cores = {}
    if os.path.exists(OUT):
        for line in open(OUT):
            if line.strip() and not line.startswith("#"):
                n, c = line.split()[:2]
                cores[n] = float(c)
    for n, w in wall.items():
        if n in cpu and w >= 5.0:  # shorter ones: too few samples to tell (they take two slots)
            cores[n] = cpu[n] / w
    with open(OUT, "w") as f:
        f.write("# test, cores it keeps busy on average, ctest slots (two a core) "
                "(scripts/test_cores.py; tests/cores.cmake)\n")
        for n in sorted(cores):
            f.write("%s %.2f %d\n" % (n, cores[n], slots(cores[n])))
    print("wrote %d tests' cores to %s" % (len(cores), os.path.relpath(OUT)))
    sys.exit(rc)


if __name__ == "__main__":
    main()
