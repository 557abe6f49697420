#!/usr/bin/python3
"""The GPT trained by Limbo and by PyTorch for Python side by side: the same
scripted module (same initial weights), the same windows, batch and
optimizer settings; held-out loss in nats per byte after the same number of
steps. Runs alternate (Limbo, PyTorch, Limbo, ...) over --seeds seeds (the
seed draws the order of the training windows in each system).

    examples/gpt/compare.py [--steps 600] [--seeds 3] [--optimizers adamw,sgd] [--data DIR]

AdamW: lr 3e-3, weight decay 0.01, clipping at 1.0. SGD: momentum 0.9,
lr 0.3 (the best of 0.1, 0.3, 1.0 in PyTorch)."""
import argparse
import json
import os
import statistics
import subprocess
import tempfile

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SETTINGS = {
    "adamw": {"lr": 3e-3, "weight_decay": 0.01, "clip": 1.0},
    "sgd": {"lr": 0.3, "momentum": 0.9, "clip": 0.0},
}


def held_out_loss(model, x, y, chunk=250):
    model.eval()
    total = 0.0
    with torch.no_grad():
        for i in range(0, len(x), chunk):
            out = model(x[i:i + chunk])
            total += torch.nn.functional.cross_entropy(out, y[i:i + chunk], reduction="sum").item()
    model.train()
    return total / y.numel()


def pytorch_run(data, algo, steps, batch, seed):
    torch.set_num_threads(2)
    model = torch.jit.load(os.path.join(data, "gpt.pt"))
    model.train()
    xs = torch.from_numpy(np.load(os.path.join(data, "train_x.npy")).astype(np.int64))
    ys = torch.from_numpy(np.load(os.path.join(data, "train_y.npy")))
    xt = torch.from_numpy(np.load(os.path.join(data, "test_x.npy")).astype(np.int64))
    yt = torch.from_numpy(np.load(os.path.join(data, "test_y.npy")))
    s = SETTINGS[algo]
    params = list(model.parameters())
    if algo == "adamw":
        opt = torch.optim.AdamW(params, lr=s["lr"], weight_decay=s["weight_decay"])
    else:
        opt = torch.optim.SGD(params, lr=s["lr"], momentum=s["momentum"])
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(xs), generator=g)
    at = 0
    for _ in range(steps):
        if at + batch > len(order):
            order, at = torch.randperm(len(xs), generator=g), 0
        idx = order[at:at + batch]
        at += batch
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(xs[idx]), ys[idx])
        loss.backward()
        if s["clip"] > 0:
            torch.nn.utils.clip_grad_norm_(params, s["clip"])
        opt.step()
    return held_out_loss(model, xt, yt)


def limbo_run(limbo, data, algo, steps, batch, seed, run_dir):
    s = SETTINGS[algo]
    sets = ["model.name=torchscript", f"model.path={data}/gpt.pt", "data.dataset=tensors", f"data.path={data}",
            f"data.batch_size={batch}", f"optim.algorithm={algo}", f"optim.lr={s['lr']}",
            f"optim.clip_grad_norm={s['clip']}", f"train.max_steps={steps}", f"train.seed={seed}",
            "train.threads=2", "train.progress=false", "train.checkpoint_every_epochs=0"]
    sets += [f"optim.weight_decay={s['weight_decay']}"] if algo == "adamw" else [f"optim.momentum={s['momentum']}"]
    cmd = [limbo, "train", "--run-dir", run_dir]
    for x in sets:
        cmd += ["--set", x]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.load(open(os.path.join(run_dir, "summary.json")))["test_loss"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--limbo", default=os.path.join(ROOT, "build/src/cli/limbo"))
    ap.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "limbo-gpt-data"))
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--optimizers", default="adamw,sgd")
    a = ap.parse_args()
    if not os.path.exists(os.path.join(a.data, "gpt.pt")):
        subprocess.run(["/usr/bin/python3", os.path.join(HERE, "prepare.py"), a.data, "--corpus", "python",
                        "--windows", "40000"], check=True)
    rows = []
    for algo in a.optimizers.split(","):
        got = {"limbo": [], "pytorch": []}
        for seed in range(1, a.seeds + 1):
            with tempfile.TemporaryDirectory() as d:
                got["limbo"].append(limbo_run(a.limbo, a.data, algo, a.steps, a.batch, seed, os.path.join(d, "run")))
            got["pytorch"].append(pytorch_run(a.data, algo, a.steps, a.batch, seed))
            print(f"{algo} seed {seed}: Limbo {got['limbo'][-1]:.4f}, PyTorch {got['pytorch'][-1]:.4f}", flush=True)
        rows.append((algo, got))
    print(f"\nheld-out loss (nats/byte) after {a.steps} steps at batch {a.batch}, {a.seeds} seeds: median (range)")
    print("| optimizer | Limbo | PyTorch |")
    print("| --- | --- | --- |")
    for algo, got in rows:
        cell = lambda v: f"{statistics.median(v):.3f} ({min(v):.3f}–{max(v):.3f})"
        print(f"| {algo} | {cell(got['limbo'])} | {cell(got['pytorch'])} |")


if __name__ == "__main__":
    main()
