"""Where a benchmark's CPU goes: every process and thread on the machine,
sampled from /proc while a contender runs, summed by kind (a `limbo`
launcher, a training member, a DataLoader worker, anything else) and by
thread name.

    with CpuSampler("python_loop_worker.py") as s:
        run the contender
    print(s.report())

The window is the middle of the run: from the first sample at which the
members have run for `skip` of the members' lifetime to the last sample
before the first member exits, so start-up (imports, rendezvous) and the
end are left out. Figures are cores busy (CPU seconds a wall second)."""
import os
import threading
import time

TICK = os.sysconf("SC_CLK_TCK")


def _read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _cpu_group(pid):
    """The process's cgroup v1 cpu group ("/" for the root), or "" when unknown."""
    for line in (_read("/proc/%d/cgroup" % pid) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and "cpu" in parts[1].split(","):
            return parts[2]
    return ""


def _snapshot(marker, by_group=False):
    """{(kind, thread name): CPU seconds} for every live thread, and whether a member is alive
    (with by_group, each kind is prefixed by the process's cpu cgroup)."""
    out, members = {}, 0
    procs = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        stat = _read("/proc/%s/stat" % p)
        cmd = _read("/proc/%s/cmdline" % p)
        if stat is None or cmd is None:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        procs[int(p)] = (comm, ppid, marker in cmd and comm != "limbo")
    for pid, (comm, ppid, mine) in procs.items():
        if mine:
            kind = "loader" if procs.get(ppid, ("", 0, False))[2] else "member"
            members += kind == "member"
        elif comm == "limbo":
            kind = "launcher"
        else:
            kind = "other"
        if by_group:
            kind = _cpu_group(pid).strip("/").split("/")[-1] + ":" + kind
        try:
            tids = os.listdir("/proc/%d/task" % pid)
        except OSError:
            continue
        for t in tids:
            s = _read("/proc/%d/task/%s/stat" % (pid, t))
            if s is None:
                continue
            name = s[s.index("(") + 1:s.rindex(")")]
            f = s[s.rindex(")") + 2:].split()
            cpu = (int(f[11]) + int(f[12])) / TICK
            key = (kind, name if not kind.endswith("other") else comm)
            out[key] = out.get(key, 0.0) + cpu
    return out, members


class CpuSampler:
    def __init__(self, marker, period=0.5, skip=0.3, by_group=False):
        self.marker, self.period, self.skip, self.by_group = marker, period, skip, by_group
        self.samples = []  # (wall, {key: cpu}, members alive)
        self._stop = threading.Event()

    def __enter__(self):
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self):
        while not self._stop.is_set():
            snap, members = _snapshot(self.marker, self.by_group)
            self.samples.append((time.monotonic(), snap, members))
            self._stop.wait(self.period)

    def window(self):
        """Cores busy by key over the middle of the members' lifetime, and its length in seconds."""
        alive = [i for i, (_, _, m) in enumerate(self.samples) if m]
        if len(alive) < 4:
            return {}, 0.0
        most = max(self.samples[i][2] for i in alive)
        full = [i for i in alive if self.samples[i][2] == most]
        a, b = full[0], full[-1]
        a = min(b - 1, a + int(self.skip * (b - a)))
        (t0, s0, _), (t1, s1, _) = self.samples[a], self.samples[b]
        dt = t1 - t0
        # A thread born in the window counts from zero; one gone by its end is not counted.
        return {k: (v - s0.get(k, 0.0)) / dt for k, v in s1.items() if v - s0.get(k, 0.0) > 0}, dt

    def report(self, top=8):
        busy, dt = self.window()
        if not busy:
            return "cpu: too few samples"
        kinds = {}
        for (kind, _), v in busy.items():
            kinds[kind] = kinds.get(kind, 0.0) + v
        threads = sorted(((v, "%s/%s" % k) for k, v in busy.items() if not k[0].endswith("other")),
                         reverse=True)[:top]
        return ("cpu over %.0f s, cores busy: " % dt + " ".join("%s %.3f" % kv for kv in sorted(kinds.items())) +
                "; threads: " + " ".join("%s %.3f" % (n, v) for v, n in threads))
