#!/usr/bin/python3
"""One member of bench/full_shard_memory.py: a decoder-only transformer
(token and position embeddings, --blocks pre-norm blocks of
nn.MultiheadAttention and a GELU MLP in a ModuleList, the output tied to
the token embedding) trained with AdamW for --steps steps on random tokens,
under `limbo launch` (--mode none | state | full: limbo.Job's shard=) or
torchrun (--mode zero1: DDP with ZeroRedundancyOptimizer, gloo).

Prints one JSON line (and writes it to $FULL_SHARD_OUT/rank<r>.json): this member's resident set before the model was
built (base) and its peak over the training steps after the first two
(VmHWM, reset through /proc/self/clear_refs after step 2, read after the
last step: the model's construction and the end's gather are outside it),
in MiB, the parameter count, the largest unit's parameters and the
samples a second over the measured steps."""
import argparse
import json
import os
import sys
import time


def join_memory_limit():
    """With MEMORY_LIMIT_MIB (root, cgroup v1), this process goes into a
    memory cgroup of its own with that limit, before torch is imported, so
    that everything it holds counts (no swap here: over the limit, the
    kernel's OOM killer ends it). The group is named in MEMORY_GROUP_FILE."""
    mib = os.environ.get("MEMORY_LIMIT_MIB")
    if not mib:
        return
    path = "/sys/fs/cgroup/memory/limbo-mem-%d" % os.getpid()
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "memory.limit_in_bytes"), "w") as f:
        f.write(str(int(float(mib) * (1 << 20))))
    with open(os.path.join(path, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
    if os.environ.get("MEMORY_GROUP_FILE"):
        with open(os.environ["MEMORY_GROUP_FILE"], "a") as f:
            f.write(path + "\n")


join_memory_limit()

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from charlm import Block  # noqa: E402  (the character transformers' block: attention and a GELU MLP)


def rss(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0  # kB -> MiB
    return float("nan")


def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS


class Decoder(nn.Module):
    def __init__(self, vocab, width, blocks, heads, context):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(context, width))
        self.blocks = nn.ModuleList([Block(width, heads) for _ in range(blocks)])
        self.ln = nn.LayerNorm(width)
        self.register_buffer("mask", torch.full((context, context), float("-inf")).triu(1))
        nn.init.normal_(self.tok.weight, std=0.02)  # tied with the output: logits of a sane size
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, x):
        h = self.tok(x) + self.pos[: x.shape[1]]
        for b in self.blocks:
            h = b(h, self.mask)
        return self.ln(h) @ self.tok.weight.t()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["none", "state", "full", "zero1"], required=True)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--context", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--data-steps", type=int, default=0,
                    help="size the data set for this many steps (default --steps): a run stopped early and "
                         "resumed sees the same data")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--pattern", action="store_true",
                    help="learnable tokens (each the previous times 3 plus 1, mod the vocabulary) instead of "
                         "random ones: the loss falls")
    args = ap.parse_args()
    torch.set_num_threads(1)
    base = rss("VmRSS")
    torch.manual_seed(0)
    model = Decoder(args.vocab, args.width, args.blocks, args.heads, args.context)
    params = sum(p.numel() for p in model.parameters())
    unit = max(sum(p.numel() for p in b.parameters()) for b in model.blocks)
    g = torch.Generator().manual_seed(1)
    samples = 64 * args.batch * (args.data_steps or args.steps)
    data = torch.randint(0, args.vocab, (samples, args.context + 1), generator=g)
    if args.pattern:
        for t in range(1, args.context + 1):
            data[:, t] = (data[:, t - 1] * 3 + 1) % args.vocab

    def loss_of(ids):
        x = data[ids]
        logits = model(x[:, :-1])
        return F.cross_entropy(logits.reshape(-1, args.vocab), x[:, 1:].reshape(-1))

    times, peak, rank, now, losses = [], float("nan"), 0, {}, []
    if args.mode == "zero1":
        import torch.distributed as dist
        from torch.distributed.optim import ZeroRedundancyOptimizer
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        net = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
        for s in range(args.steps):
            ids = torch.arange((s * world + rank) * args.batch, (s * world + rank + 1) * args.batch)
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(net(data[ids][:, :-1]).reshape(-1, args.vocab), data[ids][:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            times.append(time.perf_counter())
            if s == 1:
                reset_peak()
        peak = rss("VmHWM")
        now = {k: rss(k) for k in ("RssAnon", "RssFile", "RssShmem")}
        dist.barrier()
        dist.destroy_process_group()
    else:
        sys.path.insert(0, os.environ.get("LIMBO_PYTHON_DIR", ""))
        import limbo
        opt = limbo.Optimizer("adamw", lr=args.lr)
        job = limbo.Job(model, opt, dataset=samples, batch_size=args.batch, max_steps=args.steps, epochs=1,
                        batch_policy="none", checkpoint_every_epochs=0, shard=args.mode)
        # SAMPLES_DIR: each committed step's global batch, a line a step
        # (the experiment checks that no sample is used twice).
        log = open(os.path.join(os.environ["SAMPLES_DIR"], "samples-%d.txt" % os.getpid()), "a") \
            if os.environ.get("SAMPLES_DIR") else None
        for ids in job.batches(lambda ids: torch.as_tensor(ids)):
            job.backward(loss_of(ids))
            global_ids = job.global_ids()
            if job.step():
                losses.append(job.loss)
                if log:
                    log.write("%d %s\n" % (job.step_count, " ".join(map(str, global_ids))))
                    log.flush()
                if os.environ.get("PRINT_STEPS"):
                    print("step %d loss %.4f rss %.0f MiB" % (job.step_count, job.loss, rss("VmRSS")), flush=True)
                times.append(time.perf_counter())
                if job.step_count == 2:
                    reset_peak()
                if job.step_count == args.steps:
                    peak = rss("VmHWM")
                    now = {k: rss(k) for k in ("RssAnon", "RssFile", "RssShmem")}
        rank, world = job.rank, job.world
        if os.environ.get("PRINT_STEPS"):
            print("training over, rss %.0f MiB" % rss("VmRSS"), flush=True)
        job.finish()
        if os.environ.get("PRINT_STEPS"):
            print("finished, rss %.0f MiB, peak %.0f MiB" % (rss("VmRSS"), rss("VmHWM")), flush=True)
    rate = (len(times) - 2) * args.batch * world / (times[-1] - times[1]) if len(times) > 2 else float("nan")
    line = json.dumps({"mode": args.mode, "rank": rank, "world": world, "base_mib": base, "peak_mib": peak,
                       "params": params, "unit_params": unit, "samples_per_second": rate,
                       "after_last_step_mib": now, "losses": losses})
    print(line, flush=True)
    if os.environ.get("FULL_SHARD_OUT"):  # one file a member: the members' lines would interleave
        name = "rank%d.json" % rank if not os.environ.get("SAMPLES_DIR") else "rank%d-pid%d.json" % (rank, os.getpid())
        with open(os.path.join(os.environ["FULL_SHARD_OUT"], name), "w") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
