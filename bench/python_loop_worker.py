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
    """The data set, the model and the batch a member (None: the bench's)."""
    torch.manual_seed(1)
    if name.startswith("charlm"):
        import charlm
        return charlm.data_and_model(name)
    if name == "gpt":
        from model import Gpt
        text = subprocess.run(["bible", "Gen1:1-Rev22:21"], check=True, capture_output=True).stdout
        t = 64
        n = (len(text) - 1) // t
        raw = torch.frombuffer(bytearray(text[:n * t + 1]), dtype=torch.uint8).long()
        idx = torch.arange(n)[:, None] * t + torch.arange(t + 1)[None]
        w = raw[idx]
        return TensorDataset(w[:, :-1].contiguous(), w[:, 1:].contiguous()), Gpt(context=t), None
    from train_throughput import LeNet, Mlp, load_fmnist
    x, y = load_fmnist()
    model = LeNet() if name == "lenet" else Mlp(width=2048, depth=3) if name == "mlp10m" else Mlp()
    return TensorDataset(x, y), model, None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["ddp", "limbo", "plain"], required=True,
                    help="plain: one process, no framework (the loop's own cost)")
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--batch", type=int, default=0, help="samples a member a step (0: the model's, or 64)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--data", choices=["loader", "indexed"], default="loader",
                    help="a DataLoader (per-sample fetch and collate), or batches indexed from the tensors")
    ap.add_argument("--optimizer", choices=["torch", "limbo"], default="torch",
                    help="limbo: limbo.Optimizer (Limbo's fused update over the flat parameters)")
    ap.add_argument("--loader-workers", type=int, default=0, help="the DataLoader's worker processes")
    ap.add_argument("--phases", action="store_true",
                    help="also report each phase's median ms a step: data, forward, backward, clip, step")
    ap.add_argument("--clip", type=float, default=0.0,
                    help="clip_grad_norm_ by hand between backward and the step (0: off)")
    ap.add_argument("--shares", choices=["equal", "pace"], default="equal",
                    help="limbo: slices of the global batch equal, or by each member's pace")
    ap.add_argument("--cpu-limit", default="",
                    help="RANK:FRACTION[:PERIOD_US]: the member of that rank holds itself to FRACTION of a core "
                         "(cgroup v1 cpu controller, scripts/cpu_limit.py) once its group has formed")
    ap.add_argument("--freeze-hidden", action="store_true",
                    help="the MLP's hidden layers frozen (requires_grad False): only its output layer trains")
    ap.add_argument("--frozen", choices=["may_train", "fixed"], default="may_train",
                    help="limbo: limbo.Job(frozen=...): frozen layers in Limbo's buffers (may be unfrozen), or "
                         "out of them")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("LIMBO_THREADS", os.environ.get("THREADS", "1"))))
    limited = []

    def hold(rank):  # a real slow member: a cgroup cpu quota, not a sleep
        if not args.cpu_limit or limited:
            return
        parts = args.cpu_limit.split(":")
        if rank != int(parts[0]):
            return
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
        import atexit
        import cpu_limit
        name = "limbo-bench-%d" % os.getpid()
        cpu_limit.limit(name, float(parts[1]), int(parts[2]) if len(parts) > 2 else 100000)
        cpu_limit.add(name, os.getpid())
        atexit.register(cpu_limit.remove, name)
        limited.append(name)
    data, model, model_batch = data_and_model(args.model)
    if args.freeze_hidden:  # a frozen backbone: only the output layer trains
        for layer in model.hidden:
            layer.requires_grad_(False)
    args.batch = args.batch or model_batch or 64
    channels_last = args.model == "lenet"
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    gpt = args.model == "gpt"
    charlm = args.model.startswith("charlm")

    def loss_of(net, batch):
        if charlm:  # a dict in, a dict out
            return net(batch)["loss"]
        x, y = batch
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        out = net(x)
        return F.cross_entropy(out.float(), y)

    scheduler_of = None
    if charlm:  # AdamW over two groups, a LambdaLR warm-up
        import charlm as lm
        opt_of = lambda ps: torch.optim.AdamW(lm.param_groups(model), lr=1e-3)  # noqa: E731
        scheduler_of = lambda opt: torch.optim.lr_scheduler.LambdaLR(  # noqa: E731
            opt, lambda s: min(1.0, (s + 1) / 50))
    elif gpt:
        opt_of = lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01)  # noqa: E731
    else:
        opt_of = lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9)  # noqa: E731

    def clip(params):
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(params, args.clip)

    def indexed(ids):  # a member's batch made in the loop from sample ids
        if charlm:
            return torch.utils.data.default_collate([data[i] for i in ids])
        tx, ty = data.tensors
        i = torch.as_tensor(ids)
        return tx[i], ty[i]

    times = []
    # name: [seconds a step] of the wall clock, of this thread's CPU, and of
    # its wait in the run queue (runnable, not running: preempted)
    phases, cpu, runq = {}, {}, {}

    def schedstat():  # this thread's CPU and run-queue seconds so far
        # (the run-queue wait from the kernel's schedstat: complete whenever
        # the thread runs; its CPU field lags to the last tick, thread_time not)
        try:
            with open("/proc/thread-self/schedstat") as f:
                wait = int(f.read().split()[1]) * 1e-9
        except OSError:
            wait = 0.0
        return time.thread_time(), wait
    last = [time.perf_counter(), *schedstat()]

    def mark(name):  # the time since the last mark, as this step's `name`
        now = time.perf_counter()
        if args.phases:
            used, waited = schedstat()
            phases.setdefault(name, []).append(now - last[0])
            cpu.setdefault(name, []).append(used - last[1])
            runq.setdefault(name, []).append(waited - last[2])
            last[1:] = [used, waited]
        last[0] = now
    if args.mode == "plain":
        rank, world = 0, 1
        hold(0)
        opt = opt_of(model.parameters())
        sched = scheduler_of(opt) if scheduler_of else None
        perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(1))
        per = len(data) // args.batch  # full batches an epoch: steps past it start again
        for s in range(args.steps):
            i = perm[(s % per) * args.batch:][:args.batch]
            opt.zero_grad(set_to_none=True)
            batch = indexed(i)
            mark("data")
            loss = loss_of(model, batch)
            mark("forward")
            loss.backward()
            mark("backward")
            clip(model.parameters())
            mark("clip")
            opt.step()
            if sched:
                sched.step()
            loss.item()
            mark("step")
            times.append(time.perf_counter())
    elif args.mode == "ddp":
        import torch.distributed as dist
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        hold(rank)
        net = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        opt = opt_of(net.parameters())
        sched = scheduler_of(opt) if scheduler_of else None
        sampler = torch.utils.data.distributed.DistributedSampler(data, seed=1)
        loader = DataLoader(data, batch_size=args.batch, sampler=sampler, num_workers=args.loader_workers,
                            persistent_workers=args.loader_workers > 0)
        if args.data == "indexed":  # this rank's share of a seeded permutation, batch by batch
            perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(1))
            per = len(data) // (args.batch * world)

            class Indexed:  # indexes in the loop, as Limbo's fetch does
                def __iter__(self):
                    for s in range(per):
                        yield indexed(perm[(s * world + rank) * args.batch:][:args.batch])
            loader = Indexed()
        step = 0
        while step < args.steps:
            for batch in loader:
                mark("data")
                opt.zero_grad(set_to_none=True)
                loss = loss_of(net, batch)
                mark("forward")
                loss.backward()
                mark("backward")
                clip(net.parameters())
                mark("clip")
                opt.step()
                if sched:
                    sched.step()
                loss.item()
                mark("step")
                step += 1
                times.append(time.perf_counter())
                if step >= args.steps:
                    break
        dist.barrier()
        dist.destroy_process_group()
    else:
        import limbo
        if args.optimizer == "limbo":
            opt = limbo.Optimizer("adamw", lr=1e-3, weight_decay=0.01) if gpt or charlm else \
                limbo.Optimizer("sgd", lr=0.01, momentum=0.9)
        else:
            opt = opt_of(model.parameters())
        sched = scheduler_of(opt) if scheduler_of and args.optimizer == "torch" else None
        job = limbo.Job(model, opt, dataset=data, batch_size=args.batch, epochs=100, scheduler=sched,
                        max_steps=args.steps, batch_policy="none", checkpoint_every_epochs=0, shares=args.shares,
                        frozen=args.frozen)
        loader = DataLoader(data, batch_sampler=job.sampler, num_workers=args.loader_workers)
        if args.data == "indexed":
            loader = indexed
        for batch in job.batches(loader):
            hold(job.rank)
            mark("data")
            loss = loss_of(model, batch)
            mark("forward")
            job.backward(loss)
            mark("backward")
            clip(model.parameters())
            mark("clip")
            job.step()
            mark("step")
            times.append(time.perf_counter())
        rank, world = job.rank, job.world
        job.finish()
    if rank == 0:
        span = times[-1] - times[args.warmup - 1]
        rate = (len(times) - args.warmup) * args.batch * world / span
        out = {"samples_per_second": rate}
        if args.phases:  # medians over the steps after the warm-up, in ms
            import statistics
            out["phases_ms"] = {k: round(1000 * statistics.median(v[args.warmup:]), 3) for k, v in phases.items()}
            # the main thread's CPU time in each phase: below the wall time, the process waited or was preempted
            out["phases_mean_ms"] = {k: round(1000 * statistics.mean(v[args.warmup:]), 3) for k, v in phases.items()}
            out["phases_cpu_ms"] = {k: round(1000 * statistics.median(v[args.warmup:]), 3) for k, v in cpu.items()}
            # wall = CPU + run-queue wait (preempted) + blocked (asleep: a lock, the GIL, I/O, a collective)
            out["phases_runq_ms"] = {k: round(1000 * statistics.mean(v[args.warmup:]), 3) for k, v in runq.items()}
            out["phases_blocked_ms"] = {k: round(1000 * statistics.mean(
                [w - c - q for w, c, q in zip(phases[k], cpu[k], runq[k])][args.warmup:]), 3) for k in phases}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
