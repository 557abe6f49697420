#!/usr/bin/python3
"""One worker of bench/python_loop.py: the same PyTorch loop, model and data,
driven by DistributedDataParallel (--ddp, at its best: gradient_as_bucket_view,
channels-last for LeNet) or by the `limbo` module (--limbo, under
`limbo launch`). Rank 0 prints {"samples_per_second": ...} over the steps
after the first --warmup (the start, the group's formation and the first
steps' allocations left out)."""
import argparse
import json
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "examples", "gpt"))


def data_and_model(name):
    torch.manual_seed(1)
    if name == "gpt":
        from model import Gpt
        text = subprocess.run(["bible", "Gen1:1-Rev22:21"], check=True, capture_output=True).stdout
        t = 64
        n = (len(text) - 1) // t
        raw = torch.frombuffer(bytearray(text[:n * t + 1]), dtype=torch.uint8).long()
        idx = torch.arange(n)[:, None] * t + torch.arange(t + 1)[None]
        w = raw[idx]
        return TensorDataset(w[:, :-1].contiguous(), w[:, 1:].contiguous()), Gpt(context=t)
    from train_throughput import LeNet, Mlp, load_fmnist
    x, y = load_fmnist()
    model = LeNet() if name == "lenet" else Mlp(width=2048, depth=3) if name == "mlp10m" else Mlp()
    return TensorDataset(x, y), model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["ddp", "limbo", "plain"], required=True,
                    help="plain: one process, no framework (the loop's own cost)")
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--data", choices=["loader", "indexed"], default="loader",
                    help="a DataLoader (per-sample fetch and collate), or batches indexed from the tensors")
    ap.add_argument("--optimizer", choices=["torch", "limbo"], default="torch",
                    help="limbo: limbo.Optimizer (Limbo's fused update over the flat parameters)")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("LIMBO_THREADS", os.environ.get("THREADS", "1"))))
    data, model = data_and_model(args.model)
    channels_last = args.model == "lenet"
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    gpt = args.model == "gpt"

    def loss_of(net, x, y):
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        out = net(x)
        return F.cross_entropy(out.float(), y)

    if gpt:
        opt_of = lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01)  # noqa: E731
    else:
        opt_of = lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9)  # noqa: E731
    times = []
    if args.mode == "plain":
        rank, world = 0, 1
        opt = opt_of(model.parameters())
        tx, ty = data.tensors
        perm = torch.randperm(len(ty), generator=torch.Generator().manual_seed(1))
        for s in range(args.steps):
            i = perm[s * args.batch:][:args.batch]
            opt.zero_grad(set_to_none=True)
            loss = loss_of(model, tx[i], ty[i])
            loss.backward()
            opt.step()
            loss.item()
            times.append(time.perf_counter())
    elif args.mode == "ddp":
        import torch.distributed as dist
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        net = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        opt = opt_of(net.parameters())
        sampler = torch.utils.data.distributed.DistributedSampler(data, seed=1)
        loader = DataLoader(data, batch_size=args.batch, sampler=sampler, num_workers=0)
        if args.data == "indexed":  # this rank's share of a seeded permutation, batch by batch
            tx, ty = data.tensors
            perm = torch.randperm(len(ty), generator=torch.Generator().manual_seed(1))
            per = len(ty) // (args.batch * world)

            class Indexed:  # indexes in the loop, as Limbo's fetch does
                def __iter__(self):
                    for s in range(per):
                        i = perm[(s * world + rank) * args.batch:][:args.batch]
                        yield tx[i], ty[i]
            loader = Indexed()
        step = 0
        while step < args.steps:
            for x, y in loader:
                opt.zero_grad(set_to_none=True)
                loss = loss_of(net, x, y)
                loss.backward()
                opt.step()
                loss.item()
                step += 1
                times.append(time.perf_counter())
                if step >= args.steps:
                    break
        dist.barrier()
        dist.destroy_process_group()
    else:
        import limbo
        if args.optimizer == "limbo":
            opt = limbo.Optimizer("adamw", lr=1e-3, weight_decay=0.01) if gpt else \
                limbo.Optimizer("sgd", lr=0.01, momentum=0.9)
        else:
            opt = opt_of(model.parameters())
        job = limbo.Job(model, opt, dataset=data, batch_size=args.batch, epochs=100,
                        max_steps=args.steps, batch_policy="none", checkpoint_every_epochs=0)
        loader = DataLoader(data, batch_sampler=job.sampler, num_workers=0)
        if args.data == "indexed":
            tx, ty = data.tensors
            loader = lambda ids: (tx[torch.tensor(ids)], ty[torch.tensor(ids)])  # noqa: E731
        for x, y in job.batches(loader):
            loss = loss_of(model, x, y)
            job.backward(loss)
            job.step()
            times.append(time.perf_counter())
        rank, world = job.rank, job.world
        job.finish()
    if rank == 0:
        span = times[-1] - times[args.warmup - 1]
        rate = (len(times) - args.warmup) * args.batch * world / span
        print(json.dumps({"samples_per_second": rate}), flush=True)


if __name__ == "__main__":
    main()
