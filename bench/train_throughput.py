#!/usr/bin/python3
"""Training throughput: Limbo against PyTorch for Python, side by side.

PyTorch runs in its default (NCHW) memory format and, for conv nets, also
with channels-last weights and inputs, which is Limbo's default
(model.channels_last); ratios against both are printed.

Trains the same model (mlp, lenet) on Fashion-MNIST with the same batch size
and number of steps in both, with the same SGD settings, for several thread
settings, and prints samples/s, the ratio Limbo/PyTorch at each side's best
thread setting, and the FLOP/s reached against a measured matmul peak.

    bench/train_throughput.py [--limbo build/src/cli/limbo] [--steps 600]
"""
import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

FMNIST = "/usr/share/datasets/fashion-mnist"


def load_fmnist():
    with gzip.open(os.path.join(FMNIST, "train-images-idx3-ubyte.gz")) as f:
        x = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 1, 28, 28)
    with gzip.open(os.path.join(FMNIST, "train-labels-idx1-ubyte.gz")) as f:
        y = np.frombuffer(f.read(), np.uint8, offset=8)
    x = torch.from_numpy(x.astype(np.float32) / 255.0)
    x = (x - x.mean()) / x.std()
    return x, torch.from_numpy(y.astype(np.int64))


class LeNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 20, 5)
        self.conv2 = nn.Conv2d(20, 50, 5)
        self.fc1 = nn.Linear(800, 500)
        self.fc2 = nn.Linear(500, 10)

    def forward(self, x):
        x = F.max_pool2d(self.conv1(x), 2)
        x = F.max_pool2d(self.conv2(x), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class Mlp(nn.Module):
    def __init__(self, width=256, depth=2):
        super().__init__()
        dims = [784] + [width] * depth
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))
        self.out = nn.Linear(dims[-1], 10)

    def forward(self, x):
        x = x.flatten(1)
        for l in self.hidden:
            x = F.relu(l(x))
        return self.out(x)


def train_flops_per_sample(model):
    """Forward multiply-adds x 2 FLOPs x 3 (forward + two backward GEMMs)."""
    flops = 0
    hw = {"conv1": 24 * 24, "conv2": 8 * 8}
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            flops += 2 * m.in_features * m.out_features
        elif isinstance(m, nn.Conv2d):
            k = m.kernel_size[0] * m.kernel_size[1]
            flops += 2 * m.in_channels * m.out_channels * k * hw[name]
    return 3 * flops


def pytorch_rate(name, x, y, batch, steps, threads, channels_last=False):
    torch.set_num_threads(threads)
    torch.manual_seed(1)
    model = LeNet() if name == "lenet" else Mlp()
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    perm = torch.randperm(len(y), generator=g)
    secs = timed_steps(model, opt, x, y, perm, batch, steps, channels_last, lambda s: s * batch)
    return steps * batch / secs, model


def timed_steps(model, opt, x, y, perm, batch, steps, channels_last, start_of):
    """Runs `steps` SGD steps on batches perm[start_of(s):][:batch]; returns seconds."""
    t0 = time.perf_counter()
    for s in range(steps):
        start = start_of(s) % (len(y) - batch)
        idx = perm[start:start + batch]
        xb, yb = x[idx], y[idx]
        if channels_last:
            xb = xb.contiguous(memory_format=torch.channels_last)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        loss.item()
    return time.perf_counter() - t0


def limbo_rate(limbo, name, batch, steps, threads, blas_threads=0):
    d = tempfile.mkdtemp(prefix="limbo-bench-")
    try:
        cmd = [limbo, "train", "--run-dir", d, "--set", f"model.name={name}",
               "--set", f"data.batch_size={batch}", "--set", f"train.max_steps={steps}",
               "--set", f"train.threads={threads}", "--set", f"train.blas_threads={blas_threads}",
               "--set", "train.progress=false", "--set", "train.eval_every_epochs=0",
               "--set", "train.checkpoint_every_epochs=0", "--set", "data.test_limit=1000",
               "--set", "optim.lr=0.01", "--set", "optim.momentum=0.9"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(os.path.join(d, "summary.json")) as f:
            return json.load(f)["samples_per_second"]
    finally:
        shutil.rmtree(d, ignore_errors=True)


def matmul_peak(threads, n=1024, reps=20):
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n ** 3 * reps / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limbo", default="build/src/cli/limbo")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--models", default="mlp,lenet")
    ap.add_argument("--repeats", type=int, default=1,
                    help="repeat the whole comparison; the median ratio is printed at the end")
    args = ap.parse_args()
    cores = os.cpu_count()
    threads = sorted({1, cores})
    x, y = load_fmnist()
    peak = max(matmul_peak(t) for t in threads)
    print(f"matmul peak (torch.mm 1024^2 fp32, best of threads {threads}): {peak / 1e9:.1f} GFLOP/s")
    print(f"batch {args.batch}, {args.steps} steps, SGD momentum 0.9\n")
    ratios = {}
    for rep in range(args.repeats):
        compare(args, x, y, threads, peak, ratios)
    if args.repeats > 1:
        for name, rs in ratios.items():
            rs = sorted(rs)
            print(f"{name}: limbo / best pytorch over {len(rs)} repeats: median {rs[len(rs) // 2]:.2f}x "
                  f"(range {rs[0]:.2f}-{rs[-1]:.2f}x)")


def compare(args, x, y, threads, peak, ratios):
    print(f"{'model':6} {'side':8} {'threads':>7} {'blas':>5} {'samples/s':>10}")
    for name in args.models.split(","):
        best_t, best_c, best_l = (0, None), (0, None), (0, None)
        for t in threads:
            r, model = pytorch_rate(name, x, y, args.batch, args.steps, t)
            print(f"{name:6} {'pytorch':8} {t:7d} {'omp':>5} {r:10.0f}")
            best_t = max(best_t, (r, t))
            if name != "mlp":
                rc, _ = pytorch_rate(name, x, y, args.batch, args.steps, t, channels_last=True)
                print(f"{name:6} {'pytorch-cl':10} {t:5d} {'omp':>5} {rc:10.0f}")
                best_c = max(best_c, (rc, t))
            for blas in (0, 1):
                rl = limbo_rate(args.limbo, name, args.batch, args.steps, t, blas)
                print(f"{name:6} {'limbo':8} {t:7d} {('omp' if blas == 0 else '1'):>5} {rl:10.0f}")
                best_l = max(best_l, (rl, t))
        ratios.setdefault(name, []).append(best_l[0] / best_t[0])
        fl = train_flops_per_sample(model)
        print(f"{name}: best limbo {best_l[0]:.0f}/s ({best_l[1]} thr) vs best pytorch "
              f"{best_t[0]:.0f}/s ({best_t[1]} thr): ratio {best_l[0] / best_t[0]:.2f}x; "
              + (f"vs pytorch channels-last {best_c[0]:.0f}/s: {best_l[0] / best_c[0]:.2f}x; "
                 if best_c[1] else "") +
              f"{fl / 1e6:.2f} MFLOP/sample -> limbo {best_l[0] * fl / 1e9:.2f} GFLOP/s "
              f"= {100 * best_l[0] * fl / peak:.0f}% of matmul peak\n")


if __name__ == "__main__":
    sys.exit(main())
