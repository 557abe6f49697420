#!/usr/bin/python3
"""Elastic recovery time: SIGKILL or SIGSTOP one of 3 workers mid-epoch, and
start a new worker by hand into a running job; report the median and max
time from the event to the survivors' re-formed group and next completed
step, split into its parts, over several trials. Then "slow is not dead":
a fault-free job slowed about 3x by CPU hogs must lose no member.

    bench/recovery.py [--limbo build/src/cli/limbo] [--trials 5]
    bench/recovery.py --hosts [--trials 5]     # across two network namespaces (root)
    bench/recovery.py --etcd [--trials 5]      # embedded store vs etcd, side by side
    bench/recovery.py --shard [--trials 5]     # SIGKILL with sharded optimizer state vs replicated

--etcd: the SIGSTOP and SIGKILL trials on the embedded store and on an etcd
(a single member started here on loopback, data on /dev/shm), interleaved:
member-loss detection and re-forming under etcd against the embedded store.
Then an etcd member that is stopped, not killed: a job meets through a
3-member etcd cluster, and one member (the first endpoint every client
starts on, then the raft leader) is SIGSTOPped for 5 s mid-training. A
stopped member keeps its connections open and answers nothing, so only
timeouts show it. Reported: whether the job completed, how many membership
changes it had (a dropped worker would be one), and its wall time against
the same job with no fault.

--hosts: two "hosts" (network namespaces joined by a veth pair); host A runs
`limbo launch --nproc 2` and hosts the rendezvous store, host B `limbo launch
--nproc 1`, default heartbeat settings. Host B is lost four ways, 5 trials
each, interleaved: every process killed (SIGKILL: peers see RST), every
process frozen (SIGSTOP: silence), its link cut (a partition), or only its
launcher killed (its worker is told by the kernel and leaves). Reported:
event -> survivors' group re-formed, median and max.

A stopped worker keeps its connections open, so only its missing heartbeats
show it: the coordinator drops it after --heartbeat-timeout (0.4 s) and
aborts the round, and the survivors re-form (the collective timeout is set
to 60 s here, so it cannot be what ends the wait).

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
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from limbo_run import Veth  # noqa: E402


EXTRA = []  # --shard: optim.shard_state for the sharded trials
PYTHON = None  # --python: the user's loop (charlm-s) with this many DataLoader workers
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "python_loop_worker.py")


def job_args(run_dir):
    """What `limbo launch` takes after its own options: the CLI's job, or
    (--python) the run directory and the user's PyTorch loop."""
    if PYTHON is None:
        return ["--"] + train_args(run_dir)
    return ["--run-dir", run_dir, "--", "/usr/bin/python3", WORKER, "--mode", "limbo", "--model", "charlm-s",
            "--steps", "1000000", "--loader-workers", str(PYTHON), "--clip", "1.0"]


def train_args(run_dir):
    return EXTRA + ["--run-dir", run_dir, "--set", "model.name=lenet", "--set", "data.train_limit=20000",
            "--set", "data.test_limit=500", "--set", "data.batch_size=32", "--set", "train.epochs=30",
            "--set", "train.threads=1", "--set", "train.progress=false",
            "--set", "train.checkpoint_every_epochs=0", "--set", "train.eval_every_epochs=0",
            "--set", "elastic.collective_timeout=60"]


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


def trial(limbo, kind, etcd=None):
    d = tempfile.mkdtemp(prefix="limbo-recovery-")
    run = os.path.join(d, "run")
    log = open(os.path.join(d, "launch.log"), "w")
    nproc = 2 if kind == "join" else 3
    rdzv = ["--rdzv", f"etcd://{etcd}/recovery-{os.getpid()}-{time.time_ns()}"] if etcd else []
    launcher = subprocess.Popen([limbo, "launch", "--nproc", str(nproc), "--min-workers", "1"] + rdzv
                                + job_args(run), stdout=log, stderr=subprocess.STDOUT)
    victim = joiner = None
    try:
        if not wait_for(os.path.join(run, "metrics.jsonl"), '"kind":"train"', 60):
            raise RuntimeError("training did not start")
        time.sleep(1.0)
        text = open(log.name).read()
        if kind in ("kill", "stop"):
            victim = int(re.search(r"worker rank 1 pid (\d+)", text).group(1))
            t0 = time.time()
            os.kill(victim, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
        else:
            rdzv = re.search(r"store at (\S+?),? ", text).group(1)
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
        # Event -> the survivors' group re-formed and in sync (the record's
        # time), and -> the next completed step (the record is written then).
        rec["to_reformed"] = rec["time"] - t0
        rec["to_step"] = os.path.getmtime(os.path.join(run, "metrics.jsonl")) - t0
        return rec
    finally:
        launcher.send_signal(signal.SIGTERM)
        if joiner:
            joiner.send_signal(signal.SIGTERM)
            joiner.wait()
        if victim and kind == "stop":
            os.kill(victim, signal.SIGKILL)
        launcher.wait()
        log.close()
        shutil.rmtree(d, ignore_errors=True)


def host_trial(limbo, way):
    """Loses host B of a two-host job one `way`; returns (seconds from the
    event to the survivors' re-formed group, B's launcher exit code)."""
    hosts = Veth()
    d = tempfile.mkdtemp(prefix="limbo-recovery-")
    run = os.path.join(d, "run")
    rdzv = f"{hosts.ip[0]}:{29400 + os.getpid() % 300}"
    logs = [open(os.path.join(d, f"host{h}.log"), "w") for h in range(2)]
    launchers = []
    keep = False  # a failed trial keeps its logs
    try:
        for h, nproc in ((0, 2), (1, 1)):
            launchers.append(subprocess.Popen(
                hosts.prefix(h) + [limbo, "launch", "--nproc", str(nproc), "--min-workers", "1",
                                   "--rdzv", rdzv, "--rdzv-timeout", "10", "--"] + train_args(run),
                stdout=logs[h], stderr=subprocess.STDOUT))
            if h == 0 and not wait_for(logs[0].name, "store at", 30):
                raise RuntimeError("host A did not start its store")
        if not (wait_for(logs[0].name, ": workers [1,2,3]", 60)
                and wait_for(os.path.join(run, "metrics.jsonl"), '"kind":"train"', 60)):
            raise RuntimeError("training did not start on three workers")
        time.sleep(1.0)
        t0 = time.time()
        if way == "kill":
            for p in hosts.pids(1):
                os.kill(p, signal.SIGKILL)
        elif way == "freeze":
            for p in hosts.pids(1):
                os.kill(p, signal.SIGSTOP)
        elif way == "cut":
            hosts.cut(1)
        else:  # only the launcher
            os.kill(launchers[1].pid, signal.SIGKILL)
        end = time.time() + 60
        recs = []
        while not recs and time.time() < end:
            time.sleep(0.05)
            recs = [r for r in membership_records(run) if r["time"] > t0]
        if not recs:
            keep = True
            raise RuntimeError(f"no recovery recorded after losing host B ({way}); logs kept in {d}")
        b_code = None
        if way == "cut":  # B's launcher must end on its own, with "lost the job"
            try:
                b_code = launchers[1].wait(timeout=20)
            except subprocess.TimeoutExpired:
                b_code = "still running"
        return recs[0]["time"] - t0, b_code
    finally:
        for p in launchers:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in launchers:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        hosts.close()
        for f in logs:
            f.close()
        if not keep:
            shutil.rmtree(d, ignore_errors=True)


def hosts_main(limbo, trials):
    ways = ["kill", "freeze", "cut", "launcher"]
    names = {"kill": "every process killed (SIGKILL)", "freeze": "every process frozen (SIGSTOP)",
             "cut": "link cut (partition)", "launcher": "only its launcher killed"}
    got = {w: [] for w in ways}
    codes = []
    for _ in range(trials):  # interleaved: kill, freeze, cut, launcher, kill, ...
        for w in ways:
            sec, code = host_trial(limbo, w)
            got[w].append(sec)
            if code is not None:
                codes.append(code)
    print("host B of a two-host job lost; event -> survivors' group re-formed "
          f"({trials} trials each, default heartbeat settings):")
    for w in ways:
        xs = got[w]
        print(f"  {names[w]:34s} median {statistics.median(xs):.3f} s, max {max(xs):.3f} s  "
              f"[{', '.join(f'{x:.3f}' for x in xs)}]")
    print(f"  cut-off launcher exit codes: {codes} (5 = lost the job)")


def contention(limbo, hogs, seconds=12):
    """A fault-free 3-worker job for `seconds` beside `hogs` busy processes:
    (samples/s, membership changes)."""
    d = tempfile.mkdtemp(prefix="limbo-recovery-")
    run = os.path.join(d, "run")
    busy = [subprocess.Popen(["/usr/bin/python3", "-c", "while True: pass"]) for _ in range(hogs)]
    log = open(os.path.join(d, "launch.log"), "w")
    launcher = subprocess.Popen([limbo, "launch", "--nproc", "3", "--min-workers", "1", "--"]
                                + train_args(run), stdout=log, stderr=subprocess.STDOUT)
    try:
        if not wait_for(os.path.join(run, "metrics.jsonl"), '"kind":"train"', 120):
            raise RuntimeError("training did not start")
        time.sleep(seconds)
        rates = []
        with open(os.path.join(run, "metrics.jsonl")) as f:
            for line in f:
                r = json.loads(line)
                if r.get("kind") == "train" and "samples_per_second" in r:
                    rates.append(r["samples_per_second"])
        return statistics.median(rates[1:] or rates), len(membership_records(run))
    finally:
        for b in busy:
            b.kill()
            b.wait()
        launcher.send_signal(signal.SIGTERM)
        launcher.wait()
        log.close()
        shutil.rmtree(d, ignore_errors=True)


class LocalEtcd:
    """One etcd member on loopback, data on tmpfs, for --etcd."""

    def __init__(self):
        port = 41000 + os.getpid() % 5000
        self.dir = tempfile.mkdtemp(prefix="limbo-etcd-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        self.endpoint = f"127.0.0.1:{port}"
        client, peer = f"http://{self.endpoint}", f"http://127.0.0.1:{port + 1}"
        self.proc = subprocess.Popen(["etcd", "--data-dir", self.dir + "/data", "--listen-client-urls", client,
                                      "--advertise-client-urls", client, "--listen-peer-urls", peer,
                                      "--initial-advertise-peer-urls", peer, "--initial-cluster",
                                      f"default={peer}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(2)

    def close(self):
        self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


class LocalEtcdCluster:
    """n etcd members on loopback ports, data on tmpfs."""

    def __init__(self, n=3):
        base = 43000 + (os.getpid() % 2000) * 2 * n
        self.dir = tempfile.mkdtemp(prefix="limbo-etcd3-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        names = [f"m{i}" for i in range(n)]
        peers = [f"http://127.0.0.1:{base + 2 * i + 1}" for i in range(n)]
        self.endpoints = [f"127.0.0.1:{base + 2 * i}" for i in range(n)]
        cluster = ",".join(f"{nm}={p}" for nm, p in zip(names, peers))
        self.procs = []
        for nm, ep, peer in zip(names, self.endpoints, peers):
            client = f"http://{ep}"
            self.procs.append(subprocess.Popen(
                ["etcd", "--name", nm, "--data-dir", f"{self.dir}/{nm}", "--listen-client-urls", client,
                 "--advertise-client-urls", client, "--listen-peer-urls", peer, "--initial-advertise-peer-urls",
                 peer, "--initial-cluster", cluster, "--initial-cluster-state", "new"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        end = time.time() + 20
        while time.time() < end and self.leader() is None:
            time.sleep(0.2)
        if self.leader() is None:
            self.close()
            raise RuntimeError("the etcd cluster elected no leader")

    def leader(self):
        for i, ep in enumerate(self.endpoints):
            try:
                out = subprocess.run(["etcdctl", "--endpoints", ep, "endpoint", "status", "-w", "json"],
                                     capture_output=True, text=True, timeout=2, env=dict(os.environ, ETCDCTL_API="3"))
                st = json.loads(out.stdout)[0]["Status"]
                if st["leader"] == st["header"]["member_id"]:
                    return i
            except Exception:
                pass
        return None

    def close(self):
        for p in self.procs:
            p.kill()
            p.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def stopped_etcd_trial(limbo, cluster, victim):
    """One job through `cluster`; etcd member `victim` (None: no fault) is
    SIGSTOPped for 5 s once training is under way. Returns (exit code,
    membership changes, wall seconds)."""
    d = tempfile.mkdtemp(prefix="limbo-etcdstop-")
    run = os.path.join(d, "run")
    log = open(os.path.join(d, "launch.log"), "w")
    job = f"stopped-{os.getpid()}-{time.time_ns()}"
    args = ["--run-dir", run, "--set", "model.name=lenet", "--set", "data.train_limit=6000",
            "--set", "data.test_limit=500", "--set", "data.batch_size=32", "--set", "train.epochs=4",
            "--set", "train.threads=1", "--set", "train.progress=false"]
    t0 = time.time()
    launcher = subprocess.Popen([limbo, "launch", "--nproc", "3", "--min-workers", "1", "--rdzv",
                                 "etcd://" + ",".join(cluster.endpoints) + "/" + job, "--"] + args,
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        if victim is not None:
            if not wait_for(os.path.join(run, "metrics.jsonl"), '"kind":"train"', 60):
                raise RuntimeError("training did not start")
            time.sleep(1.0)
            cluster.procs[victim].send_signal(signal.SIGSTOP)
            time.sleep(5.0)
            cluster.procs[victim].send_signal(signal.SIGCONT)
        code = launcher.wait(timeout=600)
        wall = time.time() - t0
        changes = None
        try:
            changes = json.load(open(os.path.join(run, "summary.json"))).get("membership_changes")
        except (OSError, ValueError):
            pass
        return code, changes, wall
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        log.close()
        shutil.rmtree(d, ignore_errors=True)


def stopped_etcd_main(limbo, trials):
    cluster = LocalEtcdCluster(3)
    try:
        rows = {"none": [], "first endpoint": [], "leader": []}
        for _ in range(max(1, trials)):  # interleaved: no fault, first endpoint, leader, ...
            for what in rows:
                victim = None if what == "none" else 0 if what == "first endpoint" else cluster.leader()
                if what == "leader" and victim == 0:  # make the two cases differ when they can
                    victim = cluster.leader()
                rows[what].append(stopped_etcd_trial(limbo, cluster, victim))
                time.sleep(2)  # the stopped member catches up
        for what, rs in rows.items():
            done = sum(1 for c, _, _ in rs if c == 0)
            changes = [ch for _, ch, _ in rs]
            walls = [w for _, _, w in rs]
            print(f"etcd member stopped 5 s ({what}): {done}/{len(rs)} jobs completed, membership changes "
                  f"{changes}, wall median {statistics.median(walls):.1f} s (min {min(walls):.1f}, "
                  f"max {max(walls):.1f})")
    finally:
        cluster.close()


def etcd_main(limbo, trials):
    stopped_etcd_main(limbo, min(trials, 3))
    etcd = LocalEtcd()
    try:
        got = {}
        for _ in range(trials):  # interleaved: embedded, etcd, embedded, ...
            for kind in ("stop", "kill"):
                for store in ("embedded", "etcd"):
                    rec = trial(limbo, kind, etcd.endpoint if store == "etcd" else None)
                    got.setdefault((kind, store), []).append(rec["to_reformed"])
        for (kind, store), xs in sorted(got.items()):
            what = {"kill": "SIGKILL", "stop": "SIGSTOP"}[kind]
            print(f"{store:8s} {what} -> group re-formed: median {statistics.median(xs):.3f} s, "
                  f"min {min(xs):.3f} s, max {max(xs):.3f} s ({len(xs)} trials)")
    finally:
        etcd.close()


def shard_main(limbo, trials):
    """SIGKILL recovery with the optimizer state sharded (momentum SGD, LeNet:
    the survivors re-shard, the dead worker's shard read from its home in
    shared memory) against the replicated path, interleaved."""
    global EXTRA
    got = {"replicated": [], "sharded": []}
    for _ in range(trials):
        for mode in got:
            EXTRA = ["--set", f"optim.shard_state={'true' if mode == 'sharded' else 'false'}"]
            got[mode].append(trial(limbo, "kill"))
    EXTRA = []
    for mode, rs in got.items():
        re_ = [r["to_reformed"] for r in rs]
        st = [r["to_step"] for r in rs]
        sync = [r["sync_seconds"] for r in rs]
        print(f"{mode}: SIGKILL -> group re-formed: median {statistics.median(re_):.3f} s, max {max(re_):.3f} s; "
              f"-> next completed step: median {statistics.median(st):.3f} s, max {max(st):.3f} s; "
              f"sync median {statistics.median(sync) * 1000:.1f} ms"
              + (f"; shard bytes sent median {statistics.median(r.get('shard_bytes_sent', 0) for r in rs):.0f}"
                 if mode == "sharded" else ""))
    d = statistics.median(r["to_reformed"] for r in got["sharded"]) - \
        statistics.median(r["to_reformed"] for r in got["replicated"])
    print(f"sharded - replicated, median to re-formed: {d:+.3f} s (target within 0.1 s)")


def python_main(limbo, trials, loader_workers):
    """SIGKILL and SIGSTOP of one of 3 members of the user's loop, for each
    number of DataLoader workers, interleaved (kill, stop; then the next).
    recovery_seconds is the record's first_step_seconds: from the failure
    found to the next committed step (what the CLI's records hold too)."""
    global PYTHON
    got = {}
    for _ in range(trials):
        for w in loader_workers:
            PYTHON = w
            for kind in ("kill", "stop"):
                got.setdefault((w, kind), []).append(trial(limbo, kind))
    PYTHON = None
    print("a PyTorch loop (charlm-s, DataLoader) under `limbo launch --nproc 3`; medians over %d trials (s)" % trials)
    for (w, kind), rs in sorted(got.items()):
        what = {"kill": "SIGKILL", "stop": "SIGSTOP"}[kind]
        rec = [r["first_step_seconds"] for r in rs]
        re_ = [r["to_reformed"] for r in rs]
        st = [r["to_step"] for r in rs]
        print(f"  {w} loader workers, {what:7s}: recovery_seconds {statistics.median(rec):.3f} "
              f"(max {max(rec):.3f}); event -> group re-formed {statistics.median(re_):.3f}, "
              f"-> next step {statistics.median(st):.3f} (max {max(st):.3f})")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limbo", default="build/src/cli/limbo")
    ap.add_argument("--trials", type=int, default=5, help="0: only the contention check")
    ap.add_argument("--hogs", type=int, default=6, help="busy processes for the contention run")
    ap.add_argument("--hosts", action="store_true", help="cross-host recovery in network namespaces (root)")
    ap.add_argument("--etcd", action="store_true", help="embedded store vs etcd, side by side")
    ap.add_argument("--python", default=None, metavar="W,W,...",
                    help="the trials on a user's PyTorch loop (bench/charlm.py's charlm-s, clipping, AdamW, "
                         "LambdaLR) with each of these numbers of DataLoader workers, interleaved")
    ap.add_argument("--shard", action="store_true",
                    help="SIGKILL trials with optim.shard_state = true against the replicated path, interleaved")
    args = ap.parse_args()
    if args.shard:
        shard_main(args.limbo, args.trials)
        return
    if args.etcd:
        etcd_main(args.limbo, args.trials)
        return
    if args.hosts:
        hosts_main(args.limbo, args.trials)
        return
    if args.python:
        python_main(args.limbo, args.trials, [int(w) for w in args.python.split(",")])
        return
    parts = ["detection_seconds", "rendezvous_seconds", "group_seconds", "sync_seconds",
             "first_step_seconds"]
    recs = {"kill": [], "stop": [], "join": []}
    for _ in range(args.trials):  # interleaved: kill, stop, join, kill, ...
        for kind in recs:
            recs[kind].append(trial(args.limbo, kind))
    for kind, rs in recs.items():
        if not rs:
            continue
        med = {p: statistics.median(r[p] for r in rs) for p in parts}
        print(f"{kind}: median over {len(rs)} trials (s): " +
              ", ".join(f"{p.replace('_seconds', '')} {med[p]:.3f}" for p in parts))
        re_ = [r["to_reformed"] for r in rs]
        st = [r["to_step"] for r in rs]
        what = {"kill": "SIGKILL", "stop": "SIGSTOP", "join": "process start"}[kind]
        print(f"  {what} -> group re-formed: median {statistics.median(re_):.3f} s, max {max(re_):.3f} s; "
              f"-> next completed step: median {statistics.median(st):.3f} s, max {max(st):.3f} s")
    base, base_changes = contention(args.limbo, 0)
    slow, slow_changes = contention(args.limbo, args.hogs)
    print(f"slow is not dead: {args.hogs} busy processes slowed the job {base / slow:.1f}x "
          f"({base:.0f} -> {slow:.0f} samples/s); membership changes {base_changes} without, "
          f"{slow_changes} with them")


if __name__ == "__main__":
    main()
