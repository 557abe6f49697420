#!/usr/bin/python3
"""A flood of unauthenticated connections against a running job's store.

A 3-worker elastic job with a job secret trains the MLP on one host; from
its first step to its end, strangers open connections to its store as fast
as `--rate` allows (never answering the handshake), holding at most
`--open` of them at once (the oldest closed first). Jobs with and without
the flood run interleaved; printed: each job's samples/s (the summary's),
its membership rounds beyond the first and its failed formations, and the
connections the flood opened a second.

    bench/connect_flood.py [--limbo build/src/cli/limbo] [--rate 4000] [--open 2000] [--repeats 3]

A third kind of job takes the same flood aimed at a sink (a process that
accepts and closes, off the job): what the flood costs the 2-core machine
by itself, apart from what it costs the store.
"""
import argparse
import collections
import json
import os
import re
import socket
import statistics
import subprocess
import tempfile
import threading
import time

TRAIN = ["--set", "model.name=mlp", "--set", "model.width=64", "--set", "data.train_limit=6000",
         "--set", "data.test_limit=300", "--set", "data.batch_size=16", "--set", "train.epochs=3",
         "--set", "train.threads=1", "--set", "train.progress=false"]


def wait_for(path, needle, timeout):
    end = time.time() + timeout
    while time.time() < end:
        try:
            with open(path) as f:
                text = f.read()
            if needle in text:
                return text
        except OSError:
            pass
        time.sleep(0.01)
    return None


class Flood:
    """Connects to 127.0.0.1:port at up to `rate` a second from `threads`
    threads, keeping at most `limit` connections open."""

    def __init__(self, port, rate, limit, threads=2):
        self.port, self.rate, self.limit = port, rate, limit
        self.opened = 0
        self.stop = False
        self.lock = threading.Lock()
        self.open_socks = collections.deque()
        self.threads = [threading.Thread(target=self.run, args=(rate / threads,)) for _ in range(threads)]
        for t in self.threads:
            t.start()

    def run(self, rate):
        start = time.time()
        n = 0
        while not self.stop:
            ahead = n / rate - (time.time() - start)
            if ahead > 0:
                time.sleep(ahead)
            s = socket.socket()
            s.setblocking(False)
            try:
                s.connect(("127.0.0.1", self.port))
            except BlockingIOError:
                pass
            except OSError:
                s.close()
                continue
            n += 1
            with self.lock:
                self.opened += 1
                self.open_socks.append(s)
                old = self.open_socks.popleft() if len(self.open_socks) > self.limit else None
            if old:
                old.close()

    def close(self):
        self.stop = True
        for t in self.threads:
            t.join()
        for s in self.open_socks:
            s.close()


SINK = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 0)); s.listen(4096)
print(s.getsockname()[1], flush=True)
while True:
    c, _ = s.accept(); c.close()
"""


def job(limbo, token, flood_rate, flood_open, sink=False):
    with tempfile.TemporaryDirectory(prefix="limbo-flood-") as d:
        run, log = f"{d}/run", f"{d}/launch.log"
        with open(log, "w") as f:
            p = subprocess.Popen([limbo, "launch", "--nproc", "3", "--min-workers", "1", "--token-file", token,
                                  "--", "--run-dir", run] + TRAIN, stdout=f, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        flood, t0 = None, time.time()
        sink_proc = None
        if flood_rate > 0:
            text = wait_for(log, "store at 127.0.0.1:", 60)
            port = int(re.search(r"store at 127\.0\.0\.1:(\d+)", text).group(1))
            if sink:
                sink_proc = subprocess.Popen(["/usr/bin/python3", "-c", SINK], stdout=subprocess.PIPE, text=True)
                port = int(sink_proc.stdout.readline())
            if not wait_for(f"{run}/metrics.jsonl", '"kind":"train"', 120):
                p.kill()
                raise SystemExit("the job never started training:\n" + open(log).read())
            t0 = time.time()
            flood = Flood(port, flood_rate, flood_open)
        code = p.wait(timeout=600)
        opened_rate = 0.0
        if flood:
            flood.close()
            opened_rate = flood.opened / max(1e-9, time.time() - t0)
        if sink_proc:
            sink_proc.kill()
            sink_proc.wait()
        text = open(log).read()
        s = json.load(open(f"{run}/summary.json")) if os.path.exists(f"{run}/summary.json") else {}
        return {"code": code, "samples_per_second": s.get("samples_per_second", 0.0),
                "rounds": len(re.findall(r"launch: membership round \d+", text)) - 1,
                "failed": len(re.findall(r"failed to form", text)), "flood_per_second": opened_rate}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limbo", default=os.path.join(os.path.dirname(__file__), "..", "build", "src", "cli", "limbo"))
    ap.add_argument("--rate", type=float, default=4000)
    ap.add_argument("--open", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    with tempfile.NamedTemporaryFile("w", prefix="limbo-token-", delete=False) as t:
        t.write("a-secret-of-this-bench-0123456789abcdef\n")
    os.chmod(t.name, 0o600)
    rows = {"without": [], "with": [], "at a sink": []}
    try:
        for r in range(a.repeats):
            for kind in rows:
                rows[kind].append(job(a.limbo, t.name, 0 if kind == "without" else a.rate, a.open,
                                      sink=kind == "at a sink"))
                print(f"  repeat {r + 1}, {kind} the flood: {rows[kind][-1]}", flush=True)
    finally:
        os.unlink(t.name)
    print("\n| flood | exit codes | samples/s (median, range) | extra rounds | failed formations | "
          "connections opened a second |")
    print("|---|---|---|---|---|---|")
    for kind, js in rows.items():
        sps = [j["samples_per_second"] for j in js]
        print(f"| {kind} | {','.join(str(j['code']) for j in js)} | {statistics.median(sps):,.0f} "
              f"({min(sps):,.0f}-{max(sps):,.0f}) | {max(j['rounds'] for j in js)} | "
              f"{max(j['failed'] for j in js)} | {statistics.median(j['flood_per_second'] for j in js):,.0f} |")
    med = {k: statistics.median(j["samples_per_second"] for j in v) for k, v in rows.items()}
    print(f"\nwith the flood at the store / without: {med['with'] / med['without']:.2f}; "
          f"at a sink / without: {med['at a sink'] / med['without']:.2f}")


if __name__ == "__main__":
    main()
