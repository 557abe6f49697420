#!/usr/bin/python3
"""Data-parallel throughput: `limbo launch` against PyTorch DistributedDataParallel.

Two workers on this machine (one intra-op thread each), the same model, the
same per-worker batch, the same number of steps and SGD settings; DDP uses
gloo on loopback. Contenders run interleaved (DDP with its defaults, DDP
tuned: gradient_as_bucket_view=True and channels-last for conv nets, Limbo
with its defaults (shared memory between the workers of one host, all-reduce
overlapped with backward), Limbo over Gloo on loopback (comm.shared_memory =
false), and the limit: one Limbo process with 2 threads at the same global
batch), --repeats times; prints the median global samples/s of each, the
ratios' medians with their range, and Limbo's exposed communication per step
(time the training thread waited for the all-reduce after backward, from
the run summary). --extra adds Limbo without overlap and with bf16;
--shard adds Limbo with sharded optimizer state (optim.shard_state = true);
--no-ddp leaves DDP out (Limbo's own contenders only).
Models: mlp (the default 784-256-256-10), lenet, mlp10m (784-2048-2048-2048-10,
about 10M parameters, 40 MB of gradients).

    bench/ddp_throughput.py [--limbo build/src/cli/limbo] [--steps 400] [--repeats 3]
                            [--models mlp,lenet,mlp10m] [--veth]

--veth puts the workers in two network namespaces joined by a veth pair (two
"hosts"; needs root and iproute2), --per-host N of them in each (default 1):
DDP's ranks (host = rank // N) and Limbo's two launchers (elastic, --nproc N,
--min-workers 2N) talk over 10.232.x.1/2. With N > 1, Limbo's default is the
hierarchical all-reduce (shared memory within a host, Gloo between hosts)
and "over Gloo" is one flat Gloo group (comm.shared_memory = false).

--dev-shm 1g,24m,3m instead runs Limbo alone with /dev/shm a tmpfs of each
size in a mount namespace of its own (a container's; needs root), and over
Gloo, interleaved: what the smaller shared-memory slots that fit a small
/dev/shm cost, against the first size.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from limbo_run import Veth  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
EXPOSED = {}  # (model, compression, overlap) -> Limbo's exposed communication, ms per step


def ddp_worker(rank, world, port, name, batch, steps, channels_last, master="127.0.0.1", view=False):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    sys.path.insert(0, HERE)
    from train_throughput import LeNet, Mlp, load_fmnist, timed_steps

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank,
                            world_size=world)
    x, y = load_fmnist()
    torch.manual_seed(1)
    model = LeNet() if name == "lenet" else Mlp(width=2048, depth=3) if name == "mlp10m" else Mlp()
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=view)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(1))
    dist.barrier()
    secs = timed_steps(ddp, opt, x, y, perm, batch, steps, channels_last,
                       lambda s: (s * world + rank) * batch)
    dist.barrier()
    rate = steps * batch * world / secs
    if rank == 0:
        print(json.dumps({"samples_per_second": rate}), flush=True)
    dist.destroy_process_group()


VETH = None  # set by --veth
PER_HOST = 1  # workers per host (--per-host, with --veth)


def ddp_rate(name, batch, steps, channels_last, port, view=False):
    master = VETH.ip[0] if VETH else "127.0.0.1"
    world = 2 * PER_HOST if VETH else 2
    def env(r):  # Gloo in a namespace must be told its interface
        return dict(os.environ, GLOO_SOCKET_IFNAME=VETH.dev[r // PER_HOST]) if VETH else None
    procs = [subprocess.Popen((VETH.prefix(r // PER_HOST) if VETH else []) +
                              [sys.executable, __file__, "--ddp-worker", str(r), str(port), name,
                               str(batch), str(steps), str(int(channels_last)), master, str(int(view)),
                               str(world)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env(r))
             for r in range(world)]
    try:
        out = procs[0].communicate(timeout=900)[0]
        for p in procs[1:]:
            p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise RuntimeError(f"DDP {name} did not finish within 15 minutes")
    return json.loads(out.strip().splitlines()[-1])["samples_per_second"]


def limbo_rate(limbo, name, batch, steps, compression="none", overlap=True, bucket_mb=None, shm=True,
               single=False, dev_shm=None, shard=False):
    d = tempfile.mkdtemp(prefix="limbo-ddp-bench-")
    model = ["--set", "model.name=mlp", "--set", "model.width=2048", "--set", "model.depth=3"] \
        if name == "mlp10m" else ["--set", f"model.name={name}"]
    try:
        args = model + ["--set", f"data.batch_size={batch}", "--set", f"comm.compression={compression}",
                        "--set", f"elastic.overlap={'true' if overlap else 'false'}",
                        *(["--set", f"elastic.bucket_mb={bucket_mb}"] if bucket_mb is not None else []),
                        "--set", f"train.max_steps={steps}", "--set", "train.threads=1",
                        "--set", "train.progress=false", "--set", "train.eval_every_epochs=0",
                        "--set", "train.checkpoint_every_epochs=0", "--set", "data.test_limit=500",
                        "--set", "optim.lr=0.01", "--set", "optim.momentum=0.9",
                        "--set", "elastic.batch_policy=none",
                        "--set", f"comm.shared_memory={'true' if shm else 'false'}"]
        if shard:
            args += ["--set", "optim.shard_state=true"]
        run = ["--run-dir", os.path.join(d, "r")]
        if single:  # the limit: one process, 2 threads, the same global batch
            args = [a.replace(f"data.batch_size={batch}", f"data.batch_size={2 * batch}")
                    .replace("train.threads=1", "train.threads=2") for a in args]
            subprocess.run([limbo, "train"] + run + args, check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            with open(os.path.join(d, "r", "summary.json")) as f:
                return json.load(f)["samples_per_second"]
        if VETH:  # one launcher per "host", joined through the first one's store
            rdzv = f"{VETH.ip[0]}:{29700 + os.getpid() % 200}"
            procs = []
            for r in range(2):
                procs.append(subprocess.Popen(
                    VETH.prefix(r) + [limbo, "launch", "--nproc", str(PER_HOST), "--min-workers",
                                      str(2 * PER_HOST), "--rdzv", rdzv, "--"] + run + args,
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                time.sleep(1.0)  # host A's workers take the first ranks
            try:
                if r0 := procs[0].wait(timeout=900):
                    raise RuntimeError(f"limbo launcher exited with {r0}")
                procs[1].wait(timeout=60)
            except subprocess.TimeoutExpired:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"limbo {name} did not finish within 15 minutes")
        else:
            # dev_shm: the job in a mount namespace of its own whose /dev/shm
            # is a tmpfs of that size (a container's).
            small = ["unshare", "-m", "sh", "-c",
                     f'mount -t tmpfs -o size={dev_shm} tmpfs /dev/shm && exec "$0" "$@"'] if dev_shm else []
            subprocess.run(small + [limbo, "launch", "--nproc", "2", "--"] + run + args, check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(os.path.join(d, "r", "summary.json")) as f:
            s = json.load(f)
        EXPOSED.setdefault((name, compression, overlap, bucket_mb, shm), []).append(
            s.get("communication", {}).get("exposed_communication_ms_per_step", float("nan")))
        return s["samples_per_second"]
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--ddp-worker":
        r, port, name, batch, steps, cl, master, view, world = sys.argv[2:11]
        ddp_worker(int(r), int(world), int(port), name, int(batch), int(steps), cl == "1", master, view == "1")
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limbo", default="build/src/cli/limbo")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--models", default="mlp,lenet,mlp10m")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--big-steps", type=int, default=100, help="steps for mlp10m")
    ap.add_argument("--veth", action="store_true", help="the workers in two network namespaces")
    ap.add_argument("--per-host", type=int, default=1, help="workers per namespace (with --veth)")
    ap.add_argument("--extra", action="store_true", help="also Limbo without overlap and with bf16")
    ap.add_argument("--shard", action="store_true", help="also Limbo with optim.shard_state = true")
    ap.add_argument("--no-ddp", action="store_true", help="leave DDP out")
    ap.add_argument("--dev-shm", metavar="SIZES",
                    help="instead: Limbo with /dev/shm a tmpfs of each size (e.g. 1g,24m,3m; root), "
                         "against the first size and against Gloo")
    args = ap.parse_args()
    if args.dev_shm:
        return run_dev_shm(args)
    global VETH, PER_HOST
    PER_HOST = args.per_host
    if args.veth:
        VETH = Veth()
    try:
        run_all(args)
    finally:
        if VETH:
            VETH.close()


def run_dev_shm(args):
    """What a small /dev/shm costs: the shared-memory slots shrink to fit it."""
    sizes = args.dev_shm.split(",")
    print(f"loopback; 2 workers x 1 thread, per-worker batch {args.batch}, {args.steps} steps "
          f"({args.big_steps} for mlp10m), global samples/s, {args.repeats} interleaved repeats; "
          f"/dev/shm of {', '.join(sizes)}, and Gloo")
    for name in args.models.split(","):
        steps = args.big_steps if name == "mlp10m" else args.steps
        runs = {k: [] for k in sizes + ["gloo"]}
        for _ in range(args.repeats):
            for size in sizes:
                runs[size].append(limbo_rate(args.limbo, name, args.batch, steps, dev_shm=size))
            runs["gloo"].append(limbo_rate(args.limbo, name, args.batch, steps, shm=False))
        def ratio(key):
            r = [a / b for a, b in zip(runs[key], runs[sizes[0]])]
            return f"{statistics.median(r):.2f}x ({min(r):.2f}-{max(r):.2f})"
        print(f"{name:7} " + "  ".join(f"{k} {statistics.median(v):8.0f} ({ratio(k)})" for k, v in runs.items()),
              flush=True)


def run_all(args):
    port = 29650
    print((f"two network namespaces joined by veth, {PER_HOST} per host; " if VETH else "loopback; ") +
          f"{2 * PER_HOST if VETH else 2} workers x 1 thread, per-worker batch {args.batch}, {args.steps} steps "
          f"({args.big_steps} for mlp10m), global samples/s, {args.repeats} interleaved repeats")
    for name in args.models.split(","):
        steps = args.big_steps if name == "mlp10m" else args.steps
        runs = {"ddp": [], "ddp_cl": [], "limbo": [], "limbo_gloo": [], "single": []}
        if args.extra:
            runs.update({"limbo_seq": [], "limbo_bf16": []})
        if args.shard:
            runs["limbo_shard"] = []
        for _ in range(args.repeats):
            port += 2
            if not args.no_ddp:
                runs["ddp"].append(ddp_rate(name, args.batch, steps, False, port))
                # DDP at its best: gradients as views of its buckets (no copy in
                # or out, 1.14-1.17x its default here), channels-last for conv nets.
                runs["ddp_cl"].append(ddp_rate(name, args.batch, steps, name == "lenet", port + 1, view=True))
            runs["limbo"].append(limbo_rate(args.limbo, name, args.batch, steps))
            if args.shard:
                runs["limbo_shard"].append(limbo_rate(args.limbo, name, args.batch, steps, shard=True))
            runs["limbo_gloo"].append(limbo_rate(args.limbo, name, args.batch, steps, shm=False))
            if not VETH:
                runs["single"].append(limbo_rate(args.limbo, name, args.batch, steps, single=True))
            if args.extra:
                runs["limbo_seq"].append(limbo_rate(args.limbo, name, args.batch, steps, overlap=False))
                runs["limbo_bf16"].append(limbo_rate(args.limbo, name, args.batch, steps, "bf16"))
        best = [max(a, b) for a, b in zip(runs["ddp"], runs["ddp_cl"])] or runs["limbo"]
        def ratio(key, base=None):
            r = [a / b for a, b in zip(runs[key], base or best)]
            return f"{statistics.median(r):.2f}x ({min(r):.2f}-{max(r):.2f})"
        med = {k: statistics.median(v) for k, v in runs.items() if v}
        ex = {k: statistics.median(EXPOSED[(name, c, o, None, shm)]) for k, c, o, shm in
              (("limbo", "none", True, True), ("limbo_gloo", "none", True, False))}
        if args.no_ddp:
            med["ddp"] = med["ddp_cl"] = float("nan")
        print(f"{name:7} DDP {med['ddp']:8.0f}  DDP tuned {med['ddp_cl']:8.0f}  limbo {med['limbo']:8.0f}  "
              f"limbo over Gloo {med['limbo_gloo']:8.0f}"
              + (f"  one process x 2 threads {med['single']:8.0f}" if runs["single"] else "") + "\n"
              f"        limbo / best DDP {ratio('limbo')}  over Gloo / best DDP {ratio('limbo_gloo')}"
              + (f"  limbo / one process {ratio('limbo', runs['single'])}" if runs["single"] else "") + "\n"
              f"        exposed communication ms/step: {ex['limbo']:.1f} (over Gloo {ex['limbo_gloo']:.1f})",
              flush=True)
        if args.extra:
            print(f"        no overlap / best DDP {ratio('limbo_seq')}  bf16 / best DDP {ratio('limbo_bf16')}",
                  flush=True)
        if args.shard:
            print(f"        sharded state {med['limbo_shard']:8.0f}: / best DDP {ratio('limbo_shard')}  "
                  f"/ limbo {ratio('limbo_shard', runs['limbo'])}"
                  + (f"  / one process {ratio('limbo_shard', runs['single'])}" if runs["single"] else ""),
                  flush=True)


if __name__ == "__main__":
    main()
