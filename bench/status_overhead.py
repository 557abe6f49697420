#!/usr/bin/python3
"""Status page overhead: training throughput with the status server on and
its page polled every 0.5 s (/status.json and /metrics, as a browser tab and
a Prometheus scraper would), against the same job without a status server.
Interleaved A, B, A, B, ...; medians and spread of the ratio.

    bench/status_overhead.py [--limbo build/src/cli/limbo] [--repeats 5]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.request

JOB = ["--set", "model.name=lenet", "--set", "data.train_limit=20000", "--set", "data.test_limit=500",
       "--set", "train.epochs=2", "--set", "train.progress=false", "--set", "train.threads=2",
       "--set", "train.eval_every_epochs=0"]


def run(limbo, with_status):
    d = tempfile.mkdtemp(prefix="limbo-status-bench-")
    run_dir = os.path.join(d, "run")
    args = [limbo, "train", "--run-dir", run_dir] + JOB
    if with_status:
        args += ["--status", "127.0.0.1:0"]
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    polls = [0]
    stop = threading.Event()

    def poll():
        url = None
        while not stop.is_set():
            try:
                if url is None:
                    url = open(os.path.join(run_dir, "status.url")).read().strip()
                for path in ("status.json", "metrics"):
                    urllib.request.urlopen(url + path, timeout=5).read()
                polls[0] += 1
            except OSError:
                pass
            stop.wait(0.5)

    t = threading.Thread(target=poll)
    if with_status:
        t.start()
    rc = p.wait()
    stop.set()
    if with_status:
        t.join()
    if rc != 0:
        raise RuntimeError(f"training failed with {rc}")
    sps = json.load(open(os.path.join(run_dir, "summary.json")))["samples_per_second"]
    shutil.rmtree(d, ignore_errors=True)
    return sps, polls[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limbo", default="build/src/cli/limbo")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    ratios, base, on = [], [], []
    for i in range(a.repeats):
        off, _ = run(a.limbo, False)
        with_page, polls = run(a.limbo, True)
        base.append(off)
        on.append(with_page)
        ratios.append(with_page / off)
        print(f"repeat {i + 1}: without {off:.0f} samples/s, with the page polled {with_page:.0f} "
              f"({polls} polls): {with_page / off:.3f}x", flush=True)
    print(f"with / without status page: median {statistics.median(ratios):.3f}x "
          f"(range {min(ratios):.3f}-{max(ratios):.3f}, {a.repeats} interleaved pairs; "
          f"medians {statistics.median(on):.0f} vs {statistics.median(base):.0f} samples/s)")


if __name__ == "__main__":
    main()
