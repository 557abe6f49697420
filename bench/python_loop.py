#!/usr/bin/python3
"""A user's PyTorch loop under Limbo against the same loop under DDP, and
against `limbo train` on the same model.

The same script (bench/python_loop_worker.py: the model, the data in memory,
a DataLoader, SGD with momentum, or AdamW for the GPT) runs as
  ddp      torch.distributed + DistributedDataParallel at its best
           (gradient_as_bucket_view, channels-last for LeNet), gloo;
  python   `limbo launch -- python3 worker.py` with the `limbo` module;
  cli      `limbo train` on the same model (built in: mlp, lenet, mlp10m),
           under the same launcher (not for the GPT);
  bound    the bound: the same members each running a plain loop (indexed
           batches) at once, with no communication; samples/s added up.
The charlm-s/m/l models (bench/charlm.py, a character transformer) read
Debian's King James Bible (apt-get install bible-kjv-text).
Contenders run interleaved, --repeats times; each reports global samples/s
over the steps after the first 20 (`cli`: its metrics windows after the
first). Each loop reads its data through a DataLoader (`ddp`, `python`:
the per-sample fetch and collate of a map-style data set) or indexes the
tensors in the loop (`ddp-idx`, `python-idx`: job.batches(fetch)); `py-own`
is `python-idx` with limbo.Optimizer (Limbo's fused update, as `limbo
train` has) in place of torch.optim, against `cli`. Prints
each contender's median with its range and the ratios' medians. One
intra-op thread per worker.

    bench/python_loop.py [--limbo build/src/cli/limbo] [--models mlp,lenet,gpt]
                         [--steps 200] [--repeats 3] [--hosts]

--hosts runs 2 hosts x 2 workers: two network namespaces joined by a veth
pair (needs root), one launcher (or two DDP ranks) in each. --alone runs one
process: a plain PyTorch loop (no framework), the same loop with the limbo
module (torch.optim; limbo.Optimizer) and `limbo train`: what the module
costs, and what the Python loop itself costs against the C++ one.
"""
import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from limbo_run import Veth  # noqa: E402
from cpu_sampler import CpuSampler  # noqa: E402

WORKER = os.path.join(HERE, "python_loop_worker.py")
PY = "/usr/bin/python3"
VETH = None
PER_HOST = 1
EXTRA = []  # worker options every contender gets (--loader-workers, --clip)


def last_json(out):
    for line in reversed(out.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError("no figures in the output:\n" + out[-2000:])


# glibc's heap settings that `limbo train` makes for itself and `limbo
# launch` gives the programs it starts (common/memory.h): freed activations
# stay in the heap. Given to DDP's ranks and the plain loop too, so that
# each contender runs at its best (without them DDP's LeNet ran at 0.63x).
HEAP = {"MALLOC_MMAP_THRESHOLD_": str(64 << 20), "MALLOC_TRIM_THRESHOLD_": str(512 << 20)}


def ddp(model, batch, steps, data="loader"):
    world = 2 * PER_HOST if VETH else 2
    port = 29500 + os.getpid() % 300
    master = VETH.ip[0] if VETH else "127.0.0.1"
    procs = []
    for r in range(world):
        host = r // PER_HOST
        env = dict(os.environ, MASTER_ADDR=master, MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(world),
                   THREADS="1")
        env.update(HEAP)  # the peer at its best: the heap settings Limbo's workers get
        if VETH:
            env["GLOO_SOCKET_IFNAME"] = VETH.dev[host]
        procs.append(subprocess.Popen((VETH.prefix(host) if VETH else []) +
                                      [PY, WORKER, "--mode", "ddp", "--model", model, "--batch", str(batch),
                                       "--steps", str(steps), "--data", data] + EXTRA,
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
    out = procs[0].communicate(timeout=900)[0]
    for p in procs[1:]:
        p.wait(timeout=120)
    return rate_of(out, "ddp" + ("-idx" if data == "indexed" else ""), model)


def rate_of(out, contender, model):
    """Rank 0's samples/s; with --phases its per-phase medians are printed."""
    j = last_json(out)
    if "phases_ms" in j:
        print("  phases %-14s %-9s %s" % (contender, model, " ".join("%s %.2f" % kv for kv in j["phases_ms"].items())),
              flush=True)
    if "phases_mean_ms" in j:
        print("  mean   %-14s %-9s %s" % (contender, model, " ".join("%s %.2f" % kv for kv in j["phases_mean_ms"].items())),
              flush=True)
    for key, label in (("phases_cpu_ms", "cpu"), ("phases_runq_ms", "runq"), ("phases_blocked_ms", "blocked")):
        if key in j:
            print("  %-6s %-14s %-9s %s" % (label, contender, model, " ".join("%s %.2f" % kv for kv in j[key].items())),
                  flush=True)
    return j["samples_per_second"]


def bound(model, batch, steps):
    """The same members computing with no communication: a plain loop (indexed
    batches, torch.optim) in each member's place, all at once (in the hosts'
    namespaces with --hosts); their samples/s added up. No data-parallel loop
    of these members can beat it."""
    world = 2 * PER_HOST if VETH else 2
    env = dict(os.environ, THREADS="1")
    env.update(HEAP)
    procs = [subprocess.Popen((VETH.prefix(r // PER_HOST) if VETH else []) +
                              [PY, WORKER, "--mode", "plain", "--model", model, "--batch", str(batch),
                               "--steps", str(steps)] + EXTRA,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for r in range(world)]
    return sum(last_json(p.communicate(timeout=900)[0])["samples_per_second"] for p in procs)


def launchers(limbo, after_dashes, run_dir):
    """`limbo launch` on this host (2 workers), or one per namespace (--hosts)."""
    if not VETH:
        r = subprocess.run([limbo, "launch", "--nproc", "2", "--run-dir", run_dir, "--"] + after_dashes,
                           capture_output=True, text=True, timeout=900)
        if r.returncode:
            raise RuntimeError("limbo launch exited %d:\n%s" % (r.returncode, r.stderr[-3000:]))
        return r.stdout
    rdzv = "%s:%d" % (VETH.ip[0], 29700 + os.getpid() % 200)
    procs = []
    for h in range(2):
        procs.append(subprocess.Popen(VETH.prefix(h) + [limbo, "launch", "--nproc", str(PER_HOST), "--min-workers",
                                                          str(2 * PER_HOST), "--rdzv", rdzv, "--run-dir", run_dir,
                                                          "--"] + after_dashes,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        time.sleep(1.0)
    out, err = procs[0].communicate(timeout=900)
    procs[1].communicate(timeout=120)
    if procs[0].returncode:
        raise RuntimeError("limbo launch exited %d:\n%s" % (procs[0].returncode, err[-3000:]))
    return out


def python(limbo, model, batch, steps, data="loader", optimizer="torch"):
    d = tempfile.mkdtemp(prefix="limbo-pyloop-")
    try:
        out = launchers(limbo, [PY, WORKER, "--mode", "limbo", "--model", model, "--batch", str(batch),
                                "--steps", str(steps), "--data", data, "--optimizer", optimizer] + EXTRA,
                        os.path.join(d, "r"))
        return rate_of(out, "python" + ("-idx" if data == "indexed" else "") +
                       ("-own" if optimizer == "limbo" else ""), model)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def cli(limbo, model, batch, steps):
    d = tempfile.mkdtemp(prefix="limbo-pyloop-")
    spec = ["--set", "model.name=mlp", "--set", "model.width=2048", "--set", "model.depth=3"] \
        if model == "mlp10m" else ["--set", "model.name=%s" % model]
    try:
        launchers(limbo, spec + ["--set", "data.batch_size=%d" % batch, "--set", "train.max_steps=%d" % steps,
                                 "--set", "train.progress=false", "--set", "train.eval_every_epochs=0",
                                 "--set", "train.checkpoint_every_epochs=0", "--set", "data.test_limit=500",
                                 "--set", "optim.lr=0.01", "--set", "optim.momentum=0.9",
                                 "--set", "elastic.batch_policy=none", "--set", "train.log_every=20"],
                  os.path.join(d, "r"))
        rates = []
        for path in glob.glob(os.path.join(d, "r", "metrics.jsonl")):
            rates = [json.loads(line)["samples_per_second"] for line in open(path)
                     if '"kind":"train"' in line.replace(" ", "")]
        if len(rates) < 2:
            raise RuntimeError("too few metrics windows")
        return statistics.mean(rates[1:])
    finally:
        shutil.rmtree(d, ignore_errors=True)


def alone(limbo, models, batch, steps, repeats):
    """One process, one thread: a plain PyTorch loop (indexed batches, torch.optim), the same loop
    with the limbo module (torch.optim, then limbo.Optimizer), and `limbo train`."""
    env = dict(os.environ, THREADS="1", PYTHONPATH=os.path.join(os.path.dirname(limbo), "..", "..", "python"))
    env.update(HEAP)  # the plain loop with the heap settings the module makes
    names = ["plain", "limbo-py", "limbo-own", "cli"]
    print("one process, one thread, batch %d, %d steps, %d repeats, interleaved" % (batch, steps, repeats))
    print("%-7s %-7s" % ("model", "") + "".join("%12s" % n for n in names) + "%14s%14s" % ("py/plain", "own/cli"))

    def worker(model, *extra):
        b = 0 if model.startswith("charlm") else batch
        r = subprocess.run([PY, WORKER, "--model", model, "--batch", str(b), "--steps", str(steps)] + list(extra)
                           + EXTRA,
                           env=env, capture_output=True, text=True, timeout=900)
        return last_json(r.stdout)["samples_per_second"]

    def cli_alone(model):
        d = tempfile.mkdtemp(prefix="limbo-pyloop-")
        try:
            subprocess.run([limbo, "train", "--run-dir", d, "--set", "model.name=%s" % model, "--set",
                            "data.batch_size=%d" % batch, "--set", "train.max_steps=%d" % steps, "--set",
                            "train.threads=1", "--set", "train.progress=false", "--set", "train.eval_every_epochs=0",
                            "--set", "train.checkpoint_every_epochs=0", "--set", "data.test_limit=500", "--set",
                            "optim.lr=0.01", "--set", "optim.momentum=0.9", "--set", "train.log_every=20"],
                           check=True, capture_output=True)
            rates = [json.loads(line)["samples_per_second"] for line in open(os.path.join(d, "metrics.jsonl"))
                     if '"kind":"train"' in line.replace(" ", "")]
            return statistics.mean(rates[1:])
        finally:
            shutil.rmtree(d, ignore_errors=True)

    for model in models:
        runs = {n: [] for n in names}
        for _ in range(repeats):
            runs["plain"].append(worker(model, "--mode", "plain"))
            runs["limbo-py"].append(worker(model, "--mode", "limbo", "--data", "indexed"))
            runs["limbo-own"].append(worker(model, "--mode", "limbo", "--data", "indexed", "--optimizer", "limbo"))
            if model in CLI_MODELS:
                runs["cli"].append(cli_alone(model))
        med = {k: statistics.median(v) if v else float("nan") for k, v in runs.items()}
        ratio = lambda a, b: statistics.median([x / y for x, y in zip(runs[a], runs[b])]) \
            if runs[b] else float("nan")  # noqa: E731
        print("%-7s %-7s" % (model, "median") + "".join("%12.0f" % med[n] for n in names) +
              "%13.3fx%13.3fx" % (ratio("limbo-py", "plain"), ratio("limbo-own", "cli")))
        print("%-7s %-7s" % ("", "range") + "".join(
            "%12s" % ("%.0f-%.0f" % (min(runs[n]), max(runs[n])) if runs[n] else "-") for n in names), flush=True)


CLI_MODELS = ("mlp", "lenet", "mlp10m")  # the built-in models `limbo train` runs too


def main():
    global VETH, PER_HOST
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limbo", default="build/src/cli/limbo")
    ap.add_argument("--models", default="mlp,lenet,gpt")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hosts", action="store_true", help="2 hosts x 2 workers in network namespaces")
    ap.add_argument("--alone", action="store_true",
                    help="one process: a plain PyTorch loop, the loop with the limbo module, limbo train")
    ap.add_argument("--loader-workers", type=int, default=0, help="DataLoader worker processes in every loop")
    ap.add_argument("--clip", type=float, default=0.0, help="clip_grad_norm_ by hand in every loop (0: off)")
    ap.add_argument("--phases", action="store_true",
                    help="print each run's median ms a step in data, forward, backward, clip and step "
                         "(DDP and the module; the module's data includes the previous step's end)")
    ap.add_argument("--contenders", default="ddp,python,ddp-idx,python-idx,py-own,cli,bound",
                    help="which contenders run (the ratios of those left out print nan)")
    ap.add_argument("--cpu", action="store_true",
                    help="print each run's cores busy by process kind (launcher, member, loader, other) and "
                         "its busiest threads, over the middle of the run (bench/cpu_sampler.py)")
    args = ap.parse_args()
    EXTRA.extend(["--loader-workers", str(args.loader_workers), "--clip", str(args.clip)])
    if args.phases:
        EXTRA.append("--phases")
    limbo = os.path.abspath(args.limbo)
    if args.alone:
        alone(limbo, args.models.split(","), args.batch, args.steps, args.repeats)
        return
    if args.hosts:
        VETH, PER_HOST = Veth(), 2
    try:
        where = "2 hosts x 2 workers (veth)" if VETH else "2 workers on one host"
        print("%s, batch %d per worker (GPT 32, charlm its own), %d steps, %d repeats, interleaved"
              % (where, args.batch, args.steps, args.repeats))
        names = ["ddp", "python", "ddp-idx", "python-idx", "py-own", "cli", "bound"]
        print("%-7s %-7s" % ("model", "") + "".join("%12s" % n for n in names) +
              "%10s%16s%13s%14s%14s" % ("py/ddp", "py-idx/ddp-idx", "py-own/cli", "py-idx/bound",
                                        "ddp-idx/bound"))
        for model in args.models.split(","):
            runs = {n: [] for n in names}
            contenders = [("ddp", ddp), ("python", lambda *a: python(limbo, *a)),
                          ("ddp-idx", lambda *a: ddp(*a, data="indexed")),
                          ("python-idx", lambda *a: python(limbo, *a, data="indexed")),
                          ("py-own", lambda *a: python(limbo, *a, data="indexed", optimizer="limbo"))]
            if model in CLI_MODELS:
                contenders.append(("cli", lambda *a: cli(limbo, *a)))
            contenders.append(("bound", bound))
            contenders = [c for c in contenders if c[0] in args.contenders.split(",")]
            batch = 32 if model == "gpt" else 0 if model.startswith("charlm") else args.batch
            for _ in range(args.repeats):
                for name, f in contenders:
                    if not args.cpu:
                        runs[name].append(f(model, batch, args.steps))
                        continue
                    with CpuSampler(os.path.basename(WORKER)) as s:
                        runs[name].append(f(model, batch, args.steps))
                    print("  %-10s %-9s %s" % (name, model, s.report()), flush=True)
            med = {k: statistics.median(v) if v else float("nan") for k, v in runs.items()}
            ratio = lambda a, b: statistics.median([x / y for x, y in zip(runs[a], runs[b])]) \
                if runs[a] and runs[b] else float("nan")  # noqa: E731
            spread = lambda k: ("%.0f-%.0f" if min(runs[k]) >= 100 else "%.1f-%.1f") % (  # noqa: E731
                min(runs[k]), max(runs[k])) if runs[k] else "-"
            fmt = lambda x: "%12.0f" % x if x >= 100 or x != x else "%12.1f" % x  # noqa: E731
            print("%-7s %-7s" % (model, "median") + "".join(fmt(med[n]) for n in names) +
                  "%9.3fx%15.3fx%12.3fx%13.3fx%13.3fx" % (ratio("python", "ddp"), ratio("python-idx", "ddp-idx"),
                                                        ratio("py-own", "cli"), ratio("python-idx", "bound"),
                                                        ratio("ddp-idx", "bound")))
            print("%-7s %-7s" % ("", "range") + "".join("%12s" % spread(n) for n in names), flush=True)
    finally:
        if VETH:
            VETH.close()


if __name__ == "__main__":
    main()
