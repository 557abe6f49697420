#!/usr/bin/python3
"""Members of unequal speed on three hosts: three network namespaces on a
bridge (bench/slow_link.py's Hosts, links not shaped), one worker of one
thread in each, each host's processes (its launcher and its worker, or its
DDP rank) held to --fractions of a core by a cgroup v1 cpu quota
(scripts/cpu_limit.py; needs root) from their first instruction. The same
script (bench/python_loop_worker.py, indexed batches) runs as

  equal    one `limbo launch --nproc 1` a host, the limbo module, equal slices;
  pace     the same with shares="pace";
  ddp      torch.distributed + DistributedDataParallel at its best, gloo;
  bound    the same three members as independent plain loops under the same
           limits, no communication; their rates added.

Contenders run interleaved, --repeats times; each reports global samples/s
over the steps after --warmup. Prints medians with ranges and the ratios.

    bench/unequal_hosts.py [--models mlp,gpt] [--fractions 1,0.5,0.25]
                           [--batch 2048] [--gpt-batch 32] [--steps 300]
                           [--gpt-steps 160] [--warmup 100] [--repeats 2]
"""
import argparse
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "scripts"))
import cpu_limit  # noqa: E402
from cpu_sampler import CpuSampler  # noqa: E402
import python_loop as pl  # noqa: E402
import slow_link  # noqa: E402


def held(host, argv):
    """argv run in host `host`'s namespace, in the host's cpu group from its first instruction."""
    return cpu_limit.run_in(GROUPS[host], HOSTS_PREFIX(host) + argv)


def run_all(argvs, envs):
    procs = [subprocess.Popen(held(h, argv), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for h, (argv, env) in enumerate(zip(argvs, envs))]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=1800)
        if p.returncode:
            raise RuntimeError("exited %d:\n%s" % (p.returncode, err[-3000:]))
        outs.append(out)
    return outs


def worker(model, batch, steps, *extra):
    return [pl.PY, pl.WORKER, "--model", model, "--batch", str(batch), "--steps", str(steps)] + pl.EXTRA + \
        list(extra)


def env_of(**kw):
    env = dict(os.environ, THREADS="1", LIMBO_THREADS="1", **kw)  # one thread a worker, launched or not
    env.update(pl.HEAP)
    return env


def limbo_job(limbo, model, batch, steps, shares):
    rdzv = "%s:%d" % (HOSTS.ip[0], 29600 + os.getpid() % 200)
    n = len(GROUPS)
    outs = run_all([[limbo, "launch", "--nproc", "1", "--min-workers", str(n), "--rdzv", rdzv, "--run-dir",
                     "/tmp/limbo-unequal-hosts-%d" % os.getpid(), "--"] +
                    worker(model, batch, steps, "--mode", "limbo", "--data", "indexed", "--shares", shares)
                    for _ in range(n)], [env_of() for _ in range(n)])
    return next(pl.last_json(o)["samples_per_second"] for o in outs if '"samples_per_second"' in o)


def ddp(model, batch, steps):
    n = len(GROUPS)
    port = str(29500 + os.getpid() % 300)
    outs = run_all([worker(model, batch, steps, "--mode", "ddp", "--data", "indexed") for _ in range(n)],
                   [env_of(MASTER_ADDR=HOSTS.ip[0], MASTER_PORT=port, RANK=str(r), WORLD_SIZE=str(n),
                           GLOO_SOCKET_IFNAME=HOSTS.dev[r]) for r in range(n)])
    return pl.last_json(outs[0])["samples_per_second"]


def bound(model, batch, steps):
    n = len(GROUPS)
    outs = run_all([worker(model, batch, steps, "--mode", "plain") for _ in range(n)], [env_of() for _ in range(n)])
    return sum(pl.last_json(o)["samples_per_second"] for o in outs)


def throttled(group):
    """The group's periods throttled so far and seconds throttled (cpu.stat)."""
    with open(os.path.join(cpu_limit.path(group), "cpu.stat")) as f:
        st = dict(line.split() for line in f if line.strip())
    return int(st.get("nr_throttled", 0)), int(st.get("throttled_time", 0)) * 1e-9


GROUPS, HOSTS, HOSTS_PREFIX = [], None, None


def main():
    global HOSTS, HOSTS_PREFIX
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limbo", default=os.path.join(HERE, "..", "build", "src", "cli", "limbo"))
    ap.add_argument("--models", default="mlp,gpt")
    ap.add_argument("--fractions", default="1,0.5,0.25", help="each host's share of a core")
    ap.add_argument("--period-us", type=int, default=100000)
    ap.add_argument("--batch", type=int, default=2048, help="samples a member (equal shares), the MLP")
    ap.add_argument("--gpt-batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--gpt-steps", type=int, default=160)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--contenders", default="equal,pace,ddp,bound",
                    help="which contenders run (the ratios of those left out print nan)")
    ap.add_argument("--cpu", action="store_true",
                    help="print each run's cores busy by host group and process kind (launcher, member) and "
                         "its busiest threads, and each group's throttled periods (cpu.stat)")
    a = ap.parse_args()
    if not cpu_limit.available():
        sys.exit("unequal_hosts: the cgroup v1 cpu controller is not writable here (run as root)")
    fractions = [float(f) for f in a.fractions.split(",")]
    limbo = os.path.abspath(a.limbo)
    pl.EXTRA = ["--warmup", str(a.warmup)]
    HOSTS = slow_link.Hosts(len(fractions), "none")
    HOSTS_PREFIX = lambda h: ["ip", "netns", "exec", HOSTS.ns[h]]  # noqa: E731
    for i, f in enumerate(fractions):
        GROUPS.append("limbo-unequal-host%d-%d" % (i, os.getpid()))
        cpu_limit.limit(GROUPS[-1], f, a.period_us)
    names = ["equal", "pace", "ddp", "bound"]
    try:
        print("%d hosts (namespaces), one worker of one thread each, held to %s of a core (cfs period %d us), "
              "%d repeats, interleaved" % (len(fractions), a.fractions, a.period_us, a.repeats), flush=True)
        print("%-7s %-7s" % ("model", "") + "".join("%12s" % n for n in names) +
              "".join("%14s" % r for r in ("pace/equal", "pace/ddp", "pace/bound", "equal/bound", "ddp/bound")),
              flush=True)
        for model in a.models.split(","):
            batch, steps = (a.gpt_batch, a.gpt_steps) if model == "gpt" else (a.batch, a.steps)
            runs = {n: [] for n in names}
            contenders = {"equal": lambda: limbo_job(limbo, model, batch, steps, "equal"),
                          "pace": lambda: limbo_job(limbo, model, batch, steps, "pace"),
                          "ddp": lambda: ddp(model, batch, steps),
                          "bound": lambda: bound(model, batch, steps)}
            chosen = [n for n in names if n in a.contenders.split(",")]
            for _ in range(a.repeats):
                for n in chosen:
                    if not a.cpu:
                        runs[n].append(contenders[n]())
                        continue
                    before = [throttled(g) for g in GROUPS]
                    with CpuSampler(os.path.basename(pl.WORKER), by_group=True) as s:
                        runs[n].append(contenders[n]())
                    print("  %-6s %s" % (n, s.report(top=12)), flush=True)
                    print("  %-6s throttled periods / seconds by host: %s" % (n, " ".join(
                        "%d / %.1f" % (t[0] - b[0], t[1] - b[1])
                        for t, b in zip([throttled(g) for g in GROUPS], before))), flush=True)
                print("  round: " + " ".join("%s %.1f" % (n, runs[n][-1]) for n in chosen), flush=True)
            nan = float("nan")
            med = {n: statistics.median(v) if v else nan for n, v in runs.items()}

            def ratio(x, y):
                return statistics.median(p / q for p, q in zip(runs[x], runs[y])) if runs[x] and runs[y] else nan
            print("%-7s %-7s" % (model, "median (batch %d, %d steps)" % (batch, steps)) +
                  "".join("%12.1f" % med[n] for n in names) +
                  "".join("%13.3fx" % ratio(x, y) for x, y in (("pace", "equal"), ("pace", "ddp"), ("pace", "bound"),
                                                               ("equal", "bound"), ("ddp", "bound"))), flush=True)
            print("%-7s %-7s" % ("", "range") + "".join(
                "%12s" % ("%.1f-%.1f" % (min(runs[n]), max(runs[n])) if runs[n] else "-") for n in names),
                flush=True)
    finally:
        HOSTS.close()
        for g in GROUPS:
            cpu_limit.remove(g)


if __name__ == "__main__":
    main()
