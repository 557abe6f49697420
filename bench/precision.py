#!/usr/bin/python3
"""bf16 compute (train.precision = bf16) side by side with float32 and with
PyTorch for Python's torch.autocast, interleaved run by run.

Models: mlp (784-256-256-10), lenet (channels-last on both sides), mlp4096
(784-4096-4096-10) on Fashion-MNIST, and gpt: examples/gpt's byte-level
transformer (2 layers, width 128, context 64) on token windows, with AdamW
and clipping at 1.0 (SGD with momentum 0.9 for the others). Contenders:

  single process, 2 threads:   limbo fp32, limbo bf16, pytorch fp32, pytorch bf16 (autocast)
  2 workers, 1 thread each:    limbo launch fp32 / bf16, DDP fp32 / bf16
                               (gloo, gradient_as_bucket_view, channels-last)
  --hosts: 2 "hosts" x 2 workers, 1 thread each: two network namespaces
                               joined by a veth pair (needs root and iproute2),
                               a limbo launcher in each, DDP's ranks 0-1 in one

PyTorch trains the model eagerly (for the GPT, the nn.Module that Limbo
runs scripted), its loss in float32 outside autocast, as its documentation
recommends. Prints per model the median samples/s of each contender with its
range, and the ratios (medians, ranges over the repeats): Limbo bf16 against
Limbo fp32, and against PyTorch at its best (the faster of fp32 and autocast
by median; DDP for 2 workers).

    bench/precision.py [--limbo build/src/cli/limbo] [--models mlp,lenet,mlp4096,gpt]
                       [--repeats 3] [--workers 1,2] [--gpt-data DIR] [--hosts]
"""
import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
VETH = None  # --hosts: two network namespaces (bench/limbo_run.py)
STEPS = {"mlp": 3000, "lenet": 600, "mlp4096": 100, "gpt": 150}
BATCH = {"mlp": 64, "lenet": 64, "mlp4096": 64, "gpt": 32}


# --- PyTorch side (run as a subprocess: --worker) -----------------------------

def pt_worker(a):
    import numpy as np
    import torch
    import torch.nn.functional as F
    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.join(ROOT, "examples/gpt"))
    torch.set_num_threads(a.threads)
    torch.manual_seed(1)
    ddp = a.world > 1
    if ddp:
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"tcp://{a.master}:{a.port}", rank=a.rank, world_size=a.world)
    cl = a.model == "lenet"
    if a.model == "gpt":
        from model import Gpt
        model = Gpt(context=64)
        text = np.concatenate([np.load(os.path.join(a.gpt_data, f)) for f in sorted(os.listdir(a.gpt_data))
                               if f.startswith("train-")])
        rng = np.random.default_rng(a.rank)

        def batch(_):
            o = rng.integers(0, len(text) - 65, size=a.batch)
            w = torch.from_numpy(text[o[:, None] + np.arange(65)[None]].astype(np.int64))
            return w[:, :64], w[:, 1:]
        opt_of = lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.01)
    else:
        from train_throughput import LeNet, Mlp, load_fmnist
        model = LeNet() if a.model == "lenet" else Mlp(width=4096 if a.model == "mlp4096" else 256)
        if cl:
            model = model.to(memory_format=torch.channels_last)
        x, y = load_fmnist()
        perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(a.rank))

        def batch(s):
            at = (s * a.batch) % (len(y) - a.batch)
            idx = perm[at:at + a.batch]
            xb = x[idx]
            return (xb.contiguous(memory_format=torch.channels_last) if cl else xb), y[idx]
        opt_of = lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9)
    net = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True) if ddp else model
    if a.zero:  # optimizer state sharded across the ranks (ZeRO stage 1)
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=type(opt_of([torch.zeros(1)])),
                                      **opt_of([torch.zeros(1)]).defaults)
    else:
        opt = opt_of(model.parameters())
    warm = 10
    for s in range(warm + a.steps):
        if s == warm:
            if ddp:
                dist.barrier()
            t0 = time.perf_counter()
        xb, yb = batch(s)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.bf16):
            out = net(xb)
        loss = F.cross_entropy(out.float(), yb)
        loss.backward()
        if a.model == "gpt":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss.item()
    secs = time.perf_counter() - t0
    if a.rank == 0:
        print(json.dumps({"samples_per_second": a.world * a.batch * a.steps / secs}))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pytorch_rate(model, bf16, workers, gpt_data, zero=False):
    port = free_port()
    threads = 2 if workers == 1 else 1
    host = lambda r: r * 2 // workers  # --hosts: ranks 0..n/2-1 on the first namespace
    procs = [subprocess.Popen((VETH.prefix(host(r)) if VETH else []) +
                              [sys.executable, __file__, "--worker", "--model", model, "--rank", str(r),
                               "--world", str(workers), "--port", str(port), "--threads", str(threads),
                               "--batch", str(BATCH[model]), "--steps", str(STEPS[model]),
                               "--master", VETH.ip[0] if VETH else "127.0.0.1",
                               "--gpt-data", gpt_data] + (["--bf16"] if bf16 else []) + (["--zero"] if zero else []),
                              stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, GLOO_SOCKET_IFNAME=VETH.dev[host(r)]) if VETH else None)
             for r in range(workers)]
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"pytorch {model} bf16={bf16} workers={workers} failed")
    return json.loads(outs[0].strip().splitlines()[-1])["samples_per_second"]


# --- Limbo side ------------------------------------------------------------------

def limbo_rate(limbo, model, bf16, workers, gpt_data, shard=False, summary=None):
    sets = {"data.batch_size": BATCH[model], "train.max_steps": STEPS[model],
            "train.threads": 2 if workers == 1 else 1, "train.progress": "false",
            "train.eval_every_epochs": 0, "train.checkpoint_every_epochs": 0, "data.test_limit": 500,
            "train.precision": "bf16" if bf16 else "fp32", "optim.shard_state": "true" if shard else "false"}
    if model == "gpt":
        sets.update({"model.name": "torchscript", "model.path": f"{gpt_data}/gpt.pt", "data.dataset": "tokens",
                     "data.path": gpt_data, "data.context": 64, "optim.algorithm": "adamw", "optim.lr": 0.003,
                     "optim.weight_decay": 0.01, "optim.clip_grad_norm": 1.0})
    else:
        sets.update({"model.name": "lenet" if model == "lenet" else "mlp", "optim.lr": 0.01, "optim.momentum": 0.9})
        if model == "mlp4096":
            sets["model.width"] = 4096
    args = [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]
    d = tempfile.mkdtemp(prefix="limbo-bench-")
    try:
        if VETH:  # one launcher per "host", joined through the first one's store
            rdzv = f"{VETH.ip[0]}:{29700 + os.getpid() % 200}"
            procs = []
            for h in range(2):
                procs.append(subprocess.Popen(
                    VETH.prefix(h) + [limbo, "launch", "--nproc", str(workers // 2), "--min-workers", str(workers),
                                      "--rdzv", rdzv, "--", "--run-dir", d] + args,
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                time.sleep(1.0)  # host A's workers take the first ranks
            if procs[0].wait(timeout=900) or procs[1].wait(timeout=60):
                raise RuntimeError(f"limbo {model} on two hosts failed")
        else:
            cmd = [limbo, "train", "--run-dir", d] + args if workers == 1 else \
                [limbo, "launch", "--nproc", str(workers), "--min-workers", str(workers), "--", "--run-dir", d] + args
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(os.path.join(d, "summary.json")) as f:
            s = json.load(f)
        if summary is not None:
            summary.append(s)
        return s["samples_per_second"]
    finally:
        shutil.rmtree(d, ignore_errors=True)


def med(v):
    return f"{statistics.median(v):.0f} ({min(v):.0f}–{max(v):.0f})"


def ratio(a, b):
    r = [x / y for x, y in zip(a, b)]
    return f"{statistics.median(r):.2f}× ({min(r):.2f}–{max(r):.2f})"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limbo", default=os.path.join(ROOT, "build/src/cli/limbo"))
    ap.add_argument("--models", default="mlp,lenet,mlp4096,gpt")
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gpt-data", default=os.path.join(tempfile.gettempdir(), "limbo-gpt-stream"))
    ap.add_argument("--hosts", action="store_true", help="2 network namespaces x 2 workers (needs root)")
    ap.add_argument("--master", default="127.0.0.1", help=argparse.SUPPRESS)
    # One PyTorch process of a contender (internal).
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    for k in ("--rank", "--world", "--port", "--threads", "--batch", "--steps"):
        ap.add_argument(k, type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--bf16", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--zero", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return pt_worker(a)
    limbo = os.path.abspath(a.limbo)
    global VETH
    if a.hosts:
        sys.path.insert(0, HERE)
        from limbo_run import Veth
        VETH = Veth()
        a.workers = "4"
    try:
        run_all(a, limbo)
    finally:
        if VETH:
            VETH.close()


def run_all(a, limbo):
    if "gpt" in a.models and not os.path.exists(os.path.join(a.gpt_data, "gpt.pt")):
        subprocess.run([sys.executable, os.path.join(ROOT, "examples/gpt/prepare.py"), a.gpt_data], check=True)
    for workers in [int(w) for w in a.workers.split(",")]:
        for model in a.models.split(","):
            got = {k: [] for k in ("limbo fp32", "limbo bf16", "pytorch fp32", "pytorch bf16")}
            for rep in range(a.repeats):
                for k in got:
                    side, prec = k.split()
                    f = limbo_rate if side == "limbo" else pytorch_rate
                    got[k].append(f(limbo, model, prec == "bf16", workers, a.gpt_data) if side == "limbo"
                                  else f(model, prec == "bf16", workers, a.gpt_data))
                print(f"  {model} x{workers} repeat {rep + 1}: " +
                      ", ".join(f"{k} {v[-1]:.0f}" for k, v in got.items()), flush=True)
            best = max(("pytorch fp32", "pytorch bf16"), key=lambda k: statistics.median(got[k]))
            peer = "DDP" if workers > 1 else "PyTorch"
            where = "2 hosts x 2 workers (1 thread each)" if VETH else \
                "1 process (2 threads)" if workers == 1 else f"{workers} workers (1 thread each)"
            print(f"{model}, {where}, "
                  f"samples/s median (range) of {a.repeats}:")
            for k, v in got.items():
                print(f"  {k.replace('pytorch', peer):14s} {med(v)}")
            print(f"  Limbo bf16 / Limbo fp32:            {ratio(got['limbo bf16'], got['limbo fp32'])}")
            print(f"  Limbo bf16 / {peer} at its best ({best.split()[1]}): {ratio(got['limbo bf16'], got[best])}")
            print(f"  Limbo best / {peer} at its best:     "
                  f"{ratio([max(x, y) for x, y in zip(got['limbo bf16'], got['limbo fp32'])], got[best])}",
                  flush=True)


if __name__ == "__main__":
    main()
