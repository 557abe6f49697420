#!/usr/bin/env python3
"""Holds processes to a fraction of a core with the cgroup v1 cpu controller
(root): how a slow member is made for Limbo's tests and benchmarks, rather
than with sleeps.

    cpu_limit.py set NAME FRACTION [--period-us N]   create or change the group
    cpu_limit.py add NAME PID...                     move processes into it
    cpu_limit.py remove NAME                         move them out, delete it

run_in(name, argv) wraps a command so that it starts inside the group.

From Python: limit(name, fraction, period_us), add(name, pid),
remove(name). A fraction of 1 or more lifts the limit (quota -1). The
period (default 100 ms, as container runtimes use) sets how coarse the
throttling is: a process at 50 % runs 50 ms and waits 50 ms; a shorter
period spreads the same share more evenly.
"""
import argparse
import os
import sys

ROOT = "/sys/fs/cgroup/cpu"


def path(name):
    if not name or "/" in name or name.startswith("."):
        raise ValueError("a cgroup name without '/': %r" % (name,))
    return os.path.join(ROOT, name)


def available():
    """Whether the cgroup v1 cpu controller is here and writable."""
    return os.path.isfile(os.path.join(ROOT, "cgroup.procs")) and os.access(ROOT, os.W_OK)


def _write(p, value):
    with open(p, "w") as f:
        f.write(str(value))


def limit(name, fraction, period_us=100000):
    """Creates the group `name` (or changes it): its processes together get
    `fraction` of one core."""
    if not available():
        raise PermissionError("the cgroup v1 cpu controller is not writable at %s (run as root)" % ROOT)
    if not fraction > 0:
        raise ValueError("a fraction of a core above 0, got %r" % (fraction,))
    if not 1000 <= period_us <= 1000000:
        raise ValueError("cfs period in [1000, 1000000] us, got %r" % (period_us,))
    p = path(name)
    os.makedirs(p, exist_ok=True)
    _write(os.path.join(p, "cpu.cfs_quota_us"), -1)  # the period can be changed only while unlimited
    _write(os.path.join(p, "cpu.cfs_period_us"), int(period_us))
    if fraction < 1:
        _write(os.path.join(p, "cpu.cfs_quota_us"), max(1000, int(round(fraction * period_us))))
    return p


def add(name, pid):
    """Moves process `pid` (its threads too) into the group."""
    _write(os.path.join(path(name), "cgroup.procs"), int(pid))


def run_in(name, argv):
    """argv wrapped so that it runs in the group from its first instruction
    (what it starts stays in the group too): for subprocess."""
    return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', os.path.join(path(name), "cgroup.procs")] + list(argv)


def remove(name):
    """Moves the group's processes back to the root group and deletes it."""
    p = path(name)
    if not os.path.isdir(p):
        return
    with open(os.path.join(p, "cgroup.procs")) as f:
        pids = [line.strip() for line in f if line.strip()]
    for pid in pids:
        try:
            _write(os.path.join(ROOT, "cgroup.procs"), pid)
        except OSError:
            pass  # it exited meanwhile
    os.rmdir(p)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("set")
    s.add_argument("name")
    s.add_argument("fraction", type=float)
    s.add_argument("--period-us", type=int, default=100000)
    a = sub.add_parser("add")
    a.add_argument("name")
    a.add_argument("pids", type=int, nargs="+")
    r = sub.add_parser("remove")
    r.add_argument("name")
    args = ap.parse_args()
    try:
        if args.cmd == "set":
            print(limit(args.name, args.fraction, args.period_us))
        elif args.cmd == "add":
            for pid in args.pids:
                add(args.name, pid)
        else:
            remove(args.name)
    except (OSError, ValueError) as e:
        print("cpu_limit: %s" % e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
