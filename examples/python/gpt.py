#!/usr/bin/env python3
"""The GPT example in a plain PyTorch loop, elastic under Limbo: the
byte-level transformer of examples/gpt/model.py (not scripted), a Python data
set that reads and tokenises the King James Bible itself, AdamW with
clipping, linear warm-up then cosine, bf16 autocast.

    build/src/cli/limbo launch --nproc 2 --min-workers 1 --run-dir runs/gpt-py \\
        -- python3 examples/python/gpt.py
    PYTHONPATH=build/python python3 examples/python/gpt.py --max-steps 100    # alone

The corpus comes from Debian's bible-kjv-text (`bible` prints it;
examples/gpt/setup.sh installs it); --corpus FILE reads any text file.
"""
import argparse
import math
import os
import subprocess
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "gpt"))
from model import Gpt  # noqa: E402  (examples/gpt/model.py: plain nn.Modules)

import limbo  # noqa: E402


def read_corpus(path):
    if path:
        with open(path, "rb") as f:
            return f.read()
    try:
        return subprocess.run(["bible", "Gen1:1-Rev22:21"], check=True, capture_output=True).stdout
    except FileNotFoundError:
        sys.exit("gpt.py: the `bible` command is missing: run examples/gpt/setup.sh "
                 "(apt-get install bible-kjv-text), or give --corpus FILE")


class ByteWindows(Dataset):
    """Window i: bytes [i*T, i*T + T] of the text, as (input ids, next-byte targets)."""

    def __init__(self, data, context):
        self.data, self.context = data, context

    def __len__(self):
        return (len(self.data) - 1) // self.context

    def __getitem__(self, i):
        at = i * self.context
        chunk = torch.frombuffer(bytearray(self.data[at:at + self.context + 1]), dtype=torch.uint8).long()
        return chunk[:-1], chunk[1:]


@torch.no_grad()
def evaluate(model, data, bf16):
    model.eval()
    total, n = 0.0, 0
    for x, y in DataLoader(data, batch_size=256):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(x)
        total += F.cross_entropy(logits.float(), y, reduction="sum").item()
        n += y.numel()
    model.train()
    return total / n


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", default="", help="a text file (default: the King James Bible)")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=float, default=0.05, help="share of the steps")
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--run-dir", default=None)
    args = p.parse_args()

    text = read_corpus(args.corpus)
    held = len(text) // 20  # the last 5 % held out
    train = ByteWindows(text[:-held], args.context)
    val = ByteWindows(text[-held:], args.context)
    torch.manual_seed(0)
    model = Gpt(context=args.context)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr)
    steps = args.max_steps or args.epochs * math.ceil(len(train) / args.batch_size)
    warm = max(1, int(args.warmup * steps))

    def schedule(s):  # linear warm-up, then cosine to min_lr
        if s < warm:
            return (s + 1) / warm
        t = min(1.0, (s - warm) / max(1, steps - warm))
        return (args.min_lr + (args.lr - args.min_lr) * 0.5 * (1 + math.cos(math.pi * t))) / args.lr

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    bf16 = args.precision == "bf16"
    # Clipping acts on the group's gradient, so the job does it (clip_grad_norm).
    job = limbo.Job(model, opt, scheduler=sched, dataset=train, batch_size=args.batch_size, epochs=args.epochs,
                    max_steps=args.max_steps, clip_grad_norm=1.0, run_dir=args.run_dir)
    loader = DataLoader(train, batch_sampler=job.sampler, num_workers=1)
    for x, y in job.batches(loader):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(x)
        loss = F.cross_entropy(logits.float(), y)
        job.backward(loss)
        if job.step():
            job.log(lr=opt.param_groups[0]["lr"] * job.lr_multiplier)
    val_loss = evaluate(model, val, bf16)
    summary = job.finish(test_loss=val_loss, test_perplexity=math.exp(val_loss))
    if summary is not None and job.is_writer:
        print("steps %d, validation loss %.4f, perplexity %.3f" % (summary["steps"], val_loss, math.exp(val_loss)))


if __name__ == "__main__":
    main()
