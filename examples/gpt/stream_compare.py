#!/usr/bin/python3
"""The GPT example (gpt.toml) trained by Limbo on 2 elastic workers and by
PyTorch for Python on the same module, data and steps, side by side.

Limbo: `limbo launch --nproc 2 -- --config examples/gpt/gpt.toml` (one
epoch of the token stream: AdamW, clipping at 1.0, warm-up then cosine,
bf16 autocast, 2 workers x 32 windows a step).
PyTorch: one process with 2 threads, the same scripted module (gpt.pt, same
initial weights), the same stream cut the same way (windows of 64 tiling
the stream from a random phase, shuffled), global batch 64, AdamW with the
same settings and the same learning rate at every step, clip_grad_norm_,
torch.autocast("cpu", bfloat16) with the loss in float32.
Both are evaluated on the fixed windows of val.npy under bf16 autocast.
Runs alternate (Limbo, PyTorch, ...) over --seeds seeds; prints held-out loss
(nats per byte), perplexity and training samples/s.

    examples/gpt/stream_compare.py [--data data/gpt] [--seeds 2] [--epochs 1]
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import tempfile
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
T, BATCH, LR, MIN_LR, WD, CLIP, WARMUP, WARM_START = 64, 64, 3e-3, 3e-4, 0.01, 1.0, 0.05, 0.1


def stream(data):
    parts = sorted(f for f in os.listdir(data) if f.startswith("train-"))
    return np.concatenate([np.load(os.path.join(data, f)) for f in parts]).astype(np.int64)


def lr_at(epoch, epochs):
    t = min(epoch, epochs) / epochs
    lr = MIN_LR + (LR - MIN_LR) * 0.5 * (1 + math.cos(math.pi * t))
    if epoch < WARMUP:
        lr *= WARM_START + (1 - WARM_START) * epoch / WARMUP
    return lr


def evaluate(model, data):
    val = np.load(os.path.join(data, "val.npy")).astype(np.int64)
    n = (len(val) - 1) // T
    x = torch.from_numpy(val[:n * T].reshape(n, T))
    y = torch.from_numpy(val[1:n * T + 1].reshape(n, T))
    model.eval()
    total = 0.0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for i in range(0, n, 256):
            out = model(x[i:i + 256]).float()
            total += torch.nn.functional.cross_entropy(out, y[i:i + 256], reduction="sum").item()
    model.train()
    return total / y.numel()


def pytorch_run(data, seed, epochs):
    torch.set_num_threads(2)
    model = torch.jit.load(os.path.join(data, "gpt.pt"))
    model.train()
    s = torch.from_numpy(stream(data))
    windows = (len(s) - 1) // T - 1
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    g = torch.Generator().manual_seed(seed)
    seen, t0 = 0, time.perf_counter()
    for epoch in range(epochs):
        phase = int(torch.randint(0, T, (1,), generator=g))
        order = torch.randperm(windows, generator=g)
        for at in range(0, windows, BATCH):
            ids = order[at:at + BATCH]
            w = torch.stack([s[phase + i * T: phase + i * T + T + 1] for i in ids.tolist()])
            for group in opt.param_groups:
                group["lr"] = lr_at(seen / windows, epochs)
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(w[:, :T])
            loss = torch.nn.functional.cross_entropy(out.float(), w[:, 1:])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            seen += len(ids)
    rate = seen / (time.perf_counter() - t0)
    return evaluate(model, data), rate


def limbo_run(limbo, data, seed, epochs, run_dir):
    cmd = [limbo, "launch", "--nproc", "2", "--min-workers", "2", "--run-dir", run_dir, "--",
           "--config", os.path.join(HERE, "gpt.toml")]
    for x in (f"model.path={data}/gpt.pt", f"data.path={data}", f"train.seed={seed}", f"train.epochs={epochs}",
              "train.eval_every_steps=0", "train.progress=false"):
        cmd += ["--set", x]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    s = json.load(open(os.path.join(run_dir, "summary.json")))
    return s["test_loss"], s["samples_per_second"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limbo", default=os.path.join(ROOT, "build/src/cli/limbo"))
    ap.add_argument("--data", default=os.path.join(ROOT, "data/gpt"))
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=1)
    a = ap.parse_args()
    if not os.path.exists(os.path.join(a.data, "gpt.pt")):
        subprocess.run([os.path.join(HERE, "setup.sh")], check=True)
    got = {"limbo": [], "pytorch": []}
    for seed in range(1, a.seeds + 1):
        with tempfile.TemporaryDirectory() as d:
            got["limbo"].append(limbo_run(a.limbo, a.data, seed, a.epochs, os.path.join(d, "run")))
        got["pytorch"].append(pytorch_run(a.data, seed, a.epochs))
        print(f"seed {seed}: Limbo {got['limbo'][-1][0]:.4f} ({got['limbo'][-1][1]:.0f}/s), "
              f"PyTorch {got['pytorch'][-1][0]:.4f} ({got['pytorch'][-1][1]:.0f}/s)", flush=True)
    print(f"\n{a.epochs} epoch(s), global batch {BATCH}, {a.seeds} seeds: median (range)")
    print("| | held-out loss (nats/byte) | perplexity | training samples/s |")
    print("| --- | --- | --- | --- |")
    for k, name in (("limbo", "Limbo, 2 workers (launch)"), ("pytorch", "PyTorch for Python, 1 process")):
        loss = [v[0] for v in got[k]]
        rate = [v[1] for v in got[k]]
        ppl = [math.exp(v) for v in loss]
        cell = lambda v, f: f"{statistics.median(v):{f}} ({min(v):{f}}–{max(v):{f}})"
        print(f"| {name} | {cell(loss, '.4f')} | {cell(ppl, '.3f')} | {cell(rate, '.0f')} |")


if __name__ == "__main__":
    main()
