#!/usr/bin/python3
"""Training across slow links: every-step synchronisation against DiLoCo,
measured on real shaped links.

N "hosts" (network namespaces, one worker each, one thread each) hang off a
bridge; every host's link is shaped both ways with the kernel's token bucket
(`tc qdisc add dev IF root tbf rate RATE burst B latency 100ms`; netem is
not available here, so no latency is added). One `limbo launch` runs in each
host. For each sync mode the same job (same seed, data, inner optimizer and
schedule) trains the same number of samples, and the script prints per mode:

  util     utilisation: the job's samples a second over the samples a
           second of the same members with no communication at all (mode
           "alone": one `limbo train` a host, side by side on the same
           shaped hosts, each training its share of the budget), run in the
           same round as the mode;
  fb       the share of the writer's training time in its own forward and
           backward (summary.json's compute_share), for reference;
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

Each round runs "alone" and then every mode; --rounds R repeats the round
(interleaved: alone, A, B, ..., alone, A, B, ...) and prints each figure's
median with its range.

Usage (root, iproute2 with tc):
  bench/slow_link.py [--limbo build/src/cli/limbo] [--model gpt|mlp10m]
                     [--hosts 2] [--rates 100mbit,1gbit] [--samples 64000]
                     [--modes step,step-bf16,diloco50,diloco50-int8,diloco500,diloco500-int8]
                     [--rounds 1] [--evals 8] [--json OUT] [--held 1:0.5]
The GPT needs its data first: examples/gpt/setup.sh. --held holds a host
(its launcher and worker, and its `limbo train` in the alone runs) to a
fraction of a core with a cgroup v1 cpu quota (scripts/cpu_limit.py): a
member of unequal speed, for the modes diloco50-int8 (no bound: everyone
waits), diloco50-int8-wait (the bounded wait, max_wait 1),
diloco50-int8-pace (shares of each outer step by pace) and
diloco50-int8-pace-wait (both).
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
    # A member of unequal speed (--held): the bounded wait (max_wait 1, the
    # default) and shares of each outer step by pace, with int8 pseudo-gradients.
    "diloco50-int8-wait": ["elastic.sync=\"diloco\"", "diloco.inner_steps=50", "comm.compression=\"int8\"",
                           "diloco.max_wait=1"],
    "diloco50-int8-pace": ["elastic.sync=\"diloco\"", "diloco.inner_steps=50", "comm.compression=\"int8\"",
                           "elastic.shares=\"pace\""],
    "diloco50-int8-pace-wait": ["elastic.sync=\"diloco\"", "diloco.inner_steps=50", "comm.compression=\"int8\"",
                                "elastic.shares=\"pace\"", "diloco.max_wait=1"],
    "step-pace": ["elastic.shares=\"pace\""],
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


HELD = {}  # host index: the cgroup v1 cpu group (scripts/cpu_limit.py) its processes run in (--held)


def held(h, argv):
    """argv in host h's cpu group from its first instruction (as it is, for a host not held)."""
    if h not in HELD:
        return argv
    import cpu_limit
    return cpu_limit.run_in(HELD[h], argv)


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


def run_alone(limbo, hosts, model, samples):
    """The same members with no communication: one `limbo train` in each
    host at once, each on its share of the budget (the same model, batch,
    optimizer and threads). Their samples a second, summed."""
    margs, batch, train_size = model_args(model)
    n = len(hosts.ns)
    steps = max(1, samples // (batch * n))
    runs = [tempfile.mkdtemp(prefix="limbo-alone-") for _ in range(n)]
    args = margs + ["--set", "data.batch_size=%d" % batch, "--set", "train.max_steps=%d" % steps,
                    "--set", "train.epochs=100", "--set", "optim.cosine_epochs=%g" % (samples / train_size),
                    "--set", "train.threads=1", "--set", "train.progress=false",
                    "--set", "train.eval_every_steps=0", "--set", "train.eval_every_epochs=0",
                    "--set", "train.checkpoint_every_epochs=0"]
    procs = [subprocess.Popen(held(h, ["ip", "netns", "exec", hosts.ns[h], limbo, "train", "--run-dir", runs[h]] + args),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for h in range(n)]
    errs = [p.communicate(timeout=7200)[1] for p in procs]
    rate = 0.0
    for h, p in enumerate(procs):
        if p.returncode:
            raise RuntimeError("alone: limbo train exited %d:\n%s" % (p.returncode, errs[h][-3000:]))
        with open(os.path.join(runs[h], "summary.json")) as f:
            s = json.load(f)
        rate += s["samples"] / s["train_seconds"]
        shutil.rmtree(runs[h], ignore_errors=True)
    return rate


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
                    "--set", "elastic.shares=\"equal\"",
                    "--set", "elastic.collective_timeout=600"]
    for s in sets:
        args += ["--set", s]
    rdzv = "%s:%d" % (hosts.ip[0], 29800 + os.getpid() % 100)
    before = hosts.tx_bytes()
    t0 = time.time()
    procs = []
    for h in range(n):
        procs.append(subprocess.Popen(held(h, ["ip", "netns", "exec", hosts.ns[h], limbo, "launch", "--nproc", "1",
                                               "--min-workers", str(n), "--rdzv", rdzv, "--run-dir", run, "--"] +
                                              args),
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
            "samples_per_second": s["samples"] / s["train_seconds"], "compute_share": s.get("compute_share"),
            "sync_share": s["outer_sync_seconds"] / s["train_seconds"] if "outer_sync_seconds" in s else None,
            "wire_bytes": wire, "bytes_per_sample": wire / max(s["samples"], 1), "test_loss": s["test_loss"],
            "curve": curve}


def spread(xs, fmt):
    """The median of xs, with its range when there are several."""
    xs = sorted(xs)
    med = xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2])
    if len(xs) == 1:
        return fmt % med
    return (fmt + " [" + fmt + "-" + fmt + "]") % (med, xs[0], xs[-1])


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
    ap.add_argument("--rounds", type=int, default=1, help="rounds of alone + every mode, interleaved")
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--held", default="", help="HOST:FRACTION[,...]: that host's launcher and worker held to "
                    "FRACTION of a core by a cgroup v1 cpu quota (the same in the alone runs)")
    args = ap.parse_args()
    if args.held:
        sys.path.insert(0, os.path.join(ROOT, "scripts"))
        import cpu_limit
        for item in args.held.split(","):
            h, f = item.split(":")
            HELD[int(h)] = "limbo-slow-held%s-%d" % (h, os.getpid())
            cpu_limit.limit(HELD[int(h)], float(f))
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
        rounds = []  # each: {"alone": samples/s, mode: result}
        try:
            for k in range(args.rounds):
                alone = run_alone(args.limbo, hosts, args.model, args.samples)
                print("  %s round %d alone: %.0f samples/s" % (rate, k + 1, alone), file=sys.stderr, flush=True)
                got = {}
                for m in modes:
                    r = run_mode(args.limbo, hosts, args.model, m, args.samples, args.evals)
                    r["utilisation"] = r["samples_per_second"] / alone
                    r["alone_samples_per_second"] = alone
                    got[m] = r
                    print("  %s round %d %s: %.0f samples/s, utilisation %.3f, loss %.4f (%.0f s)" %
                          (rate, k + 1, m, r["samples_per_second"], r["utilisation"], r["test_loss"],
                           r["wall_seconds"]), file=sys.stderr, flush=True)
                rounds.append({"alone": alone, "modes": got})
        finally:
            hosts.close()
        results = [rounds[-1]["modes"][m] for m in modes]  # curves: the last round's
        t_eq = min(r["train_seconds"] for r in results)
        alones = [rd["alone"] for rd in rounds]
        print("\n%s, %d hosts x 1 worker (1 thread each, %d cores here), links %s each way, %d samples a run, "
              "%d round(s)" % (args.model, args.hosts, os.cpu_count(), rate, args.samples, args.rounds))
        print("alone (no communication): %s samples/s" % spread(alones, "%.0f"))
        print("%-15s %-19s %6s %6s %-17s %10s %8s %8s" % ("mode", "util", "fb", "wait", "samp/s", "B/samp",
                                                         "loss@S", "loss@T"))
        for r in results:
            lt = loss_at(r["curve"], t_eq)
            r["loss_at_equal_time"] = lt
            r["equal_time_seconds"] = t_eq
            per = [rd["modes"][r["mode"]] for rd in rounds]
            r["rounds"] = [{"utilisation": x["utilisation"], "samples_per_second": x["samples_per_second"],
                            "alone_samples_per_second": x["alone_samples_per_second"]} for x in per]
            print("%-15s %-19s %6.3f %6s %-17s %10.0f %8.4f %8s" % (
                r["mode"], spread([x["utilisation"] for x in per], "%.3f"), r["compute_share"] or 0,
                "-" if r["sync_share"] is None else "%.3f" % r["sync_share"],
                spread([x["samples_per_second"] for x in per], "%.0f"), r["bytes_per_sample"], r["test_loss"],
                "-" if lt is None else "%.4f" % lt))
        print("(equal wall time T = %.1f s of training, the fastest mode's; util, samp/s: median [range] over rounds)"
              % t_eq)
        out.append({"rate": rate, "hosts": args.hosts, "model": args.model, "alone_samples_per_second": alones,
                    "results": results})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if HELD:
        import cpu_limit
        for g in HELD.values():
            cpu_limit.remove(g)


if __name__ == "__main__":
    main()
