#!/usr/bin/python3
"""Does a GRU train worse elastically than in one process? (fourth fault
review, S4.) A scripted GRU over the image rows of Fashion-MNIST, one epoch
of SGD with momentum, against PyTorch eager on the same model:

  eager 64 / eager 128        PyTorch, one process, that batch
  limbo 64 / limbo 128        `limbo train`, one process, that batch
  elastic 2x64 (auto|none)    `limbo launch --nproc 2`, 64 a worker (global
                              batch 128), elastic.batch_policy dynamic (the
                              default) or none

Seeds interleaved (every contender for seed 1, then seed 2, ...). Writes
results/results.md (median and range over the seeds). Usage:

  experiments/gru_elastic/run.py [--seeds 3] [--limbo build/src/cli/limbo]
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

import numpy as np
import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
# The model and the IDX reader of the TorchScript tests' fixtures.
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "python"))
from make_fixtures import FMNIST, GruRows, idx  # noqa: E402

LR, MOMENTUM = 0.05, 0.9


def load(split):
    x = torch.from_numpy(idx(f"{FMNIST}/{split}-images-idx3-ubyte.gz").astype(np.float32) / 255.0)
    y = torch.from_numpy(idx(f"{FMNIST}/{split}-labels-idx1-ubyte.gz").astype(np.int64))
    return x, y


def eager(batch, seed, data):
    (xtr, ytr), (xte, yte) = data
    mean, std = xtr.mean(), xtr.std()
    torch.manual_seed(seed)
    model = GruRows()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(xtr.shape[0], generator=g)
    for i in range(0, xtr.shape[0] - batch + 1, batch):
        ids = order[i:i + batch]
        loss = nn.functional.cross_entropy(model((xtr[ids] - mean) / std), ytr[ids])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        pred = model((xte - mean) / std).argmax(1)
    return (pred == yte).float().mean().item()


def limbo(exe, model_path, seed, batch, nproc, policy):
    d = tempfile.mkdtemp(prefix="limbo-gru-")
    try:
        sets = {"model.name": "torchscript", "model.path": json.dumps(model_path), "data.batch_size": batch,
                "optim.lr": LR, "optim.momentum": MOMENTUM, "train.epochs": 1, "train.seed": seed,
                "train.threads": 1, "train.progress": "false", "elastic.batch_policy": json.dumps(policy)}
        args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
        if nproc == 1:
            cmd = [exe, "train", "--run-dir", d] + args
        else:
            cmd = [exe, "launch", "--nproc", str(nproc), "--min-workers", "1", "--"] + ["--run-dir", d] + args
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(os.path.join(d, "summary.json")) as f:
            return json.load(f)["test_accuracy"]
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--limbo", default=os.path.join(HERE, "..", "..", "build", "src", "cli", "limbo"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    exe = os.path.abspath(a.limbo)
    data = (load("train"), load("t10k"))
    work = tempfile.mkdtemp(prefix="limbo-gru-model-")
    torch.manual_seed(0)
    model_path = os.path.join(work, "gru_rows.pt")
    torch.jit.script(GruRows()).save(model_path)
    contenders = {
        "eager 64": lambda s: eager(64, s, data),
        "eager 128": lambda s: eager(128, s, data),
        "limbo 64": lambda s: limbo(exe, model_path, s, 64, 1, "dynamic"),
        "limbo 128": lambda s: limbo(exe, model_path, s, 128, 1, "dynamic"),
        "elastic 2x64, batch_policy dynamic": lambda s: limbo(exe, model_path, s, 64, 2, "dynamic"),
        "elastic 2x64, batch_policy none": lambda s: limbo(exe, model_path, s, 64, 2, "none"),
    }
    acc = {k: [] for k in contenders}
    for seed in range(1, a.seeds + 1):
        for name, run in contenders.items():
            t0 = time.time()
            acc[name].append(run(seed))
            print(f"seed {seed}  {name:36s} {100 * acc[name][-1]:6.2f} %  ({time.time() - t0:.0f} s)", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    lines = ["| run | global batch | test accuracy % (median) | range over seeds |", "| --- | --- | --- | --- |"]
    for name, v in acc.items():
        glob = 64 if name.endswith(" 64") else 128
        lines.append(f"| {name} | {glob} | {100 * statistics.median(v):.2f} | "
                     f"{100 * min(v):.2f}–{100 * max(v):.2f} |")
    out = "\n".join(lines) + f"\n\n{a.seeds} seeds; GRU(28→48) over image rows, SGD lr {LR} momentum {MOMENTUM}, " \
        "one epoch, one thread a process.\n"
    with open(os.path.join(HERE, "results", "results.md"), "w") as f:
        f.write(out)
    print(out)


if __name__ == "__main__":
    main()
