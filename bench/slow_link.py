#!/usr/bin/python3
"""Training across slow links: every-step synchronisation against DiLoCo,
measured on real shaped links.

N "hosts" (network namespaces, one worker each, one thread each) hang off a
bridge; every host's link is shaped both ways with the kernel's token bucket
(`tc qdisc add dev IF root tbf rate RATE burst B latency 100ms`; netem is
not available here, so no latency is added). One `limbo launch` runs in each
host. For each sync mode the same job (same seed, data, inner optimizer and
schedule) trains the same number of samples, and the script prints per mode:

  util     compute utilisation: the share of a member's training time spent
           in its own forward and backward (summary.json, the writer's);
  wait     DiLoCo: the share of a member's training time spent in outer
           syncs (their agreement, all-reduce and update; inner steps run
           during an overlapped sync are not counted);
  samp/s   samples a second of the whole job (training time, evaluations
           excluded);
  B/samp   bytes on the wire a sample: every host's transmitted bytes (its
           link's counters) over the samples trained;
  loss@S   held-out loss after the whole sample budget (equal samples);
  loss@T   held-out loss at the wall time T the fastest mode took for the
           budget (equal wall time; interpolated between evaluations, "-"
           when a mode had not been evaluated by then).

Modes: step (the gradient all-reduced every step, float32), step-bf16,
diloco50 / diloco500 (H = 50 / 500 inner steps, pseudo-gradients in
float32), diloco50-int8 / diloco500-int8, diloco50-int4; streaming DiLoCo
stream50 / stream50-int8 / stream50-int4 (H = 50 in 5 fragments, one
synced every 10 inner steps and overlapping the next 5, mixing 0.5).

Usage (root, iproute2 with tc):
  bench/slow_link.py [--limbo build/src/cli/limbo] [--model gpt|mlp10m]
                     [--hosts 2] [--rates 100mbit,1gbit] [--samples 64000]
                     [--modes step,step-bf16,diloco50,diloco50-int8,diloco500,diloco500-int8]
                     [--evals 8] [--json OUT]
The GPT needs its data first: examples/gpt/setup.sh.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODES = {
    "step": [],
    "step-bf16": ["comm.compression=\"bf16\""],
    "diloco50": ["elastic.sync=\"diloco\"", "diloco.inner_steps=50"],
    "diloco50-int8": ["elastic.sync=\"diloco\"", "diloco.inner_steps=50", "comm.compression=\"int8\""],
    "diloco50-int4": ["elastic.sync=\"diloco\"", "diloco.inner_steps=50", "comm.compression=\"int4\""],
    "diloco500": ["elastic.sync=\"diloco\"", "diloco.inner_steps=500"],
    "diloco500-int8": ["elastic.sync=\"diloco\"", "diloco.inner_steps=500", "comm.compression=\"int8\""],
    # Streaming: 5 fragments, one synced every 10 inner steps, each sync
    # overlapping the next 5 inner steps, mixed half and half.
    "stream50": ["elastic.sync=\"diloco\"", "diloco.inner_steps=50", "diloco.fragments=5",
                 "diloco.overlap_steps=5", "diloco.mixing=0.5"],
    "stream50-int8": ["elastic.sync=\"diloco\"", "diloco.inner_steps=50", "diloco.fragments=5",
                      "diloco.overlap_steps=5", "diloco.mixing=0.5", "comm.compression=\"int8\""],
    "stream50-int4": ["elastic.sync=\"diloco\"", "diloco.inner_steps=50", "diloco.fragments=5",
                      "diloco.overlap_steps=5", "diloco.mixing=0.5", "comm.compression=\"int4\""],
}


def model_args(model):
    if model == "gpt":
        if not os.path.exists(os.path.join(ROOT, "data/gpt/gpt.pt")):
            sys.exit("the GPT's data is missing: run examples/gpt/setup.sh first")
        # The example's job (AdamW, clipping, warm-up then cosine, bf16), one thread a worker.
        return ["--config", os.path.join(ROOT, "examples/gpt/gpt.toml"), "--set", "model.path=\"%s\"" %
                os.path.join(ROOT, "data/gpt/gpt.pt"), "--set", "data.path=\"%s\"" % os.path.join(ROOT, "data/gpt")], 32, 63800
    if model == "mlp10m":
        return ["--set", "model.name=\"mlp\"", "--set", "model.width=2048", "--set", "model.depth=3",
                "--set", "optim.algorithm=\"adamw\"", "--set", "optim.lr=0.001", "--set", "data.test_limit=2000"], 64, 60000
    sys.exit("unknown --model " + model)


def sh(cmd, check=True):
    return subprocess.run(cmd if isinstance(cmd, list) else cmd.split(), check=check,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


class Hosts:
    """N network namespaces on a bridge (in a hub namespace of its own),
    each link shaped both ways by tbf at `rate`."""

    def __init__(self, n, rate):
        tag = os.getpid() % 200 + 20
        self.hub = "limbo-slow-hub%d" % tag
        self.ns = ["limbo-slow%d-h%d" % (tag, i) for i in range(n)]
        self.ip = ["10.233.%d.%d" % (tag, i + 1) for i in range(n)]
        self.dev = ["ls%dh%d" % (tag, i) for i in range(n)]
        self.close()
        burst = max(256 * 1024, rate_bits(rate) // 8 // 100)  # 10 ms of the rate, at least 256 KiB (> the MTU)
        cmds = ["ip netns add " + self.hub, "ip -n %s link add br0 type bridge" % self.hub,
                "ip -n %s link set br0 up" % self.hub]
        for i, ns in enumerate(self.ns):
            port = "lp%dh%d" % (tag, i)
            cmds += ["ip netns add " + ns, "ip link add %s type veth peer name %s" % (self.dev[i], port),
                     "ip link set %s netns %s" % (self.dev[i], ns), "ip link set %s netns %s" % (port, self.hub),
                     "ip -n %s link set %s master br0" % (self.hub, port), "ip -n %s link set %s up" % (self.hub, port),
                     "ip -n %s addr add %s/24 dev %s" % (ns, self.ip[i], self.dev[i]),
                     "ip -n %s link set %s up" % (ns, self.dev[i]), "ip -n %s link set lo up" % ns]
            if rate != "none":
                for where, dev in ((ns, self.dev[i]), (self.hub, port)):
                    cmds.append("ip netns exec %s tc qdisc add dev %s root tbf rate %s burst %d latency 100ms" %
                                (where, dev, rate, burst))
        try:
            for c in cmds:
                sh(c)
        except subprocess.CalledProcessError as e:
            self.close()
            sys.exit("cannot make the hosts (%s): %s" % (" ".join(e.cmd), e.stderr.strip()))

    def tx_bytes(self):
        return sum(int(sh(["ip", "netns", "exec", ns, "cat", "/sys/class/net/%s/statistics/tx_bytes" % d]).stdout)
                   for ns, d in zip(self.ns, self.dev))

    def close(self):
        for ns in getattr(self, "ns", []) + [getattr(self, "hub", "")]:
            if not ns:
                continue
            for p in sh(["ip", "netns", "pids", ns], check=False).stdout.split():
                try:
                    os.kill(int(p), 9)
                except ProcessLookupError:
                    pass
            sh(["ip", "netns", "del", ns], check=False)


def rate_bits(rate):
    if rate == "none":
        return 10 ** 10
    units = {"kbit": 10 ** 3, "mbit": 10 ** 6, "gbit": 10 ** 9}
    for u, f in units.items():
        if rate.endswith(u):
            return int(float(rate[: -len(u)]) * f)
    return int(rate)


def run_mode(limbo, hosts, model, mode, samples, evals):
    margs, batch, train_size = model_args(model)
    n = len(hosts.ns)
    sets = MODES[mode]
    inner, fragments = 1, 1
    for s in sets:
        if s.startswith("diloco.inner_steps="):
            inner = int(s.split("=")[1])
        if s.startswith("diloco.fragments="):
            fragments = int(s.split("=")[1])
    per_step = batch * n * inner // fragments  # samples a (outer) step, or a streaming unit
    steps = max(1, samples // per_step)
    every = max(1, steps // evals)
    run = tempfile.mkdtemp(prefix="limbo-slow-")
    args = margs + ["--set", "data.batch_size=%d" % batch, "--set", "train.max_steps=%d" % steps,
                    # The schedule (warm-up, cosine) over the sample budget.
                    "--set", "train.epochs=100", "--set", "optim.cosine_epochs=%g" % (samples / train_size),
                    "--set", "train.threads=1", "--set", "train.progress=false",
                    "--set", "train.eval_every_steps=%d" % every, "--set", "train.eval_every_epochs=0",
                    "--set", "train.checkpoint_every_epochs=0", "--set", "diloco.max_wait=0",
                    "--set", "elastic.collective_timeout=600"]
    for s in sets:
        args += ["--set", s]
    rdzv = "%s:%d" % (hosts.ip[0], 29800 + os.getpid() % 100)
    before = hosts.tx_bytes()
    t0 = time.time()
    procs = []
    for h in range(n):
        procs.append(subprocess.Popen(["ip", "netns", "exec", hosts.ns[h], limbo, "launch", "--nproc", "1",
                                       "--min-workers", str(n), "--rdzv", rdzv, "--run-dir", run, "--"] + args,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        time.sleep(0.5)
    errs = [p.communicate(timeout=7200)[1] for p in procs]
    wall = time.time() - t0
    if procs[0].returncode:
        raise RuntimeError("%s: limbo launch exited %d:\n%s" % (mode, procs[0].returncode, errs[0][-3000:]))
    wire = hosts.tx_bytes() - before
    with open(os.path.join(run, "summary.json")) as f:
        s = json.load(f)
    curve = []
    with open(os.path.join(run, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if r.get("kind") == "eval":
                curve.append((r["train_seconds"], r["test_loss"], r["step"]))
    shutil.rmtree(run, ignore_errors=True)
    return {"mode": mode, "samples": s["samples"], "train_seconds": s["train_seconds"], "wall_seconds": wall,
            "samples_per_second": s["samples"] / s["train_seconds"], "utilisation": s.get("compute_utilisation"),
            "sync_share": s["outer_sync_seconds"] / s["train_seconds"] if "outer_sync_seconds" in s else None,
            "wire_bytes": wire, "bytes_per_sample": wire / max(s["samples"], 1), "test_loss": s["test_loss"],
            "curve": curve}


def loss_at(curve, t):
    """The held-out loss at training time t, linear between evaluations."""
    pts = sorted(curve)
    if not pts or t < pts[0][0]:
        return None
    for (t0, l0, _), (t1, l1, _) in zip(pts, pts[1:]):
        if t0 <= t <= t1:
            return l0 + (l1 - l0) * (t - t0) / max(t1 - t0, 1e-9)
    return pts[-1][1]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limbo", default=os.path.join(ROOT, "build/src/cli/limbo"))
    ap.add_argument("--model", default="gpt")
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--rates", default="100mbit,1gbit")
    ap.add_argument("--samples", type=int, default=64000)
    ap.add_argument("--modes", default="step,step-bf16,diloco50,diloco50-int8,diloco500,diloco500-int8")
    ap.add_argument("--evals", type=int, default=8, help="evaluations a run (about)")
    ap.add_argument("--json", help="write every figure here")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (network namespaces and tc)")
    if not shutil.which("tc"):
        sys.exit("needs tc (iproute2)")
    modes = args.modes.split(",")
    for m in modes:
        if m not in MODES:
            sys.exit("unknown mode %s; known: %s" % (m, ", ".join(MODES)))
    out = []
    for rate in args.rates.split(","):
        hosts = Hosts(args.hosts, rate)
        try:
            results = []
            for m in modes:
                r = run_mode(args.limbo, hosts, args.model, m, args.samples, args.evals)
                results.append(r)
                print("  %s %s: %.0f samples/s, util %.3f, loss %.4f (%.0f s)" %
                      (rate, m, r["samples_per_second"], r["utilisation"] or 0, r["test_loss"], r["wall_seconds"]),
                      file=sys.stderr, flush=True)
        finally:
            hosts.close()
        t_eq = min(r["train_seconds"] for r in results)
        print("\n%s, %d hosts x 1 worker (1 thread each, %d cores here), links %s each way, %d samples a run" %
              (args.model, args.hosts, os.cpu_count(), rate, args.samples))
        print("%-15s %6s %6s %8s %10s %8s %8s" % ("mode", "util", "wait", "samp/s", "B/samp", "loss@S", "loss@T"))
        for r in results:
            lt = loss_at(r["curve"], t_eq)
            r["loss_at_equal_time"] = lt
            r["equal_time_seconds"] = t_eq
            print("%-15s %6.3f %6s %8.0f %10.0f %8.4f %8s" % (
                r["mode"], r["utilisation"] or 0, "-" if r["sync_share"] is None else "%.3f" % r["sync_share"],
                r["samples_per_second"], r["bytes_per_sample"], r["test_loss"], "-" if lt is None else "%.4f" % lt))
        print("(equal wall time T = %.1f s of training, the fastest mode's)" % t_eq)
        out.append({"rate": rate, "hosts": args.hosts, "model": args.model, "results": results})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
