#!/usr/bin/python3
"""TorchScript models and memory-mapped data: throughput side by side.

Four contenders train the same LeNet (Caffe's) on Fashion-MNIST with the same
batch, steps, SGD settings and threads, interleaved run by run (A, B, C, D,
A, B, ...):

  pt-nchw,  PyTorch for Python training the nn.Module eagerly, NCHW and
  pt-cl     channels-last (bench/train_throughput.py's loop); the one with
            the higher median is PyTorch's best
  ts        limbo train on the same module scripted with torch.jit.script
            (model.name = torchscript), data from .npy files (memory-mapped)
  builtin   limbo train with its built-in lenet on the IDX files (in memory)
  mmap      limbo train with its built-in lenet on the .npy files (memory-mapped)

and prints, per repeat and as medians with their range:
  ts / best PyTorch (target >= 1.0)
  ts / builtin      (target >= 0.95)
  mmap / builtin    (memory-mapped data must not slow training)

    bench/torchscript_throughput.py [--limbo build/src/cli/limbo] [--steps 1000] [--repeats 5]
"""
import argparse
import os
import sys
import tempfile

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from limbo_run import summary_of  # noqa: E402
from train_throughput import LeNet, load_fmnist, pytorch_rate  # noqa: E402


def write_npy(d, x_u8, y):
    np.save(f"{d}/train_x.npy", x_u8)
    np.save(f"{d}/train_y.npy", y)
    np.save(f"{d}/test_x.npy", x_u8[:1000])
    np.save(f"{d}/test_y.npy", y[:1000])


def limbo_rate(limbo, args, extra):
    common = ["--set", f"data.batch_size={args.batch}", "--set", f"train.max_steps={args.steps}",
              "--set", f"train.threads={args.threads}", "--set", "train.progress=false",
              "--set", "train.eval_every_epochs=0", "--set", "train.checkpoint_every_epochs=0",
              "--set", "data.test_limit=1000", "--set", "optim.lr=0.01", "--set", "optim.momentum=0.9"]
    return summary_of([limbo, "train"], common + extra)["samples_per_second"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limbo", default="build/src/cli/limbo")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    limbo = os.path.abspath(args.limbo)
    x, y = load_fmnist()
    with tempfile.TemporaryDirectory() as d:
        # The raw uint8 images as a user would save them; Limbo standardises
        # them as it does the IDX files (data.normalize = standardize).
        import gzip
        with gzip.open("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz") as f:
            x_u8 = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 1, 28, 28)
        write_npy(d, x_u8, y.numpy())
        torch.manual_seed(1)
        torch.jit.save(torch.jit.script(LeNet()), f"{d}/lenet.pt")
        tensors = ["--set", "data.dataset=tensors", "--set", f"data.path={d}", "--set", "data.normalize=standardize"]
        contenders = {
            "pt-nchw": lambda: pytorch_rate("lenet", x, y, args.batch, args.steps, args.threads, False)[0],
            "pt-cl": lambda: pytorch_rate("lenet", x, y, args.batch, args.steps, args.threads, True)[0],
            "ts": lambda: limbo_rate(limbo, args, tensors + ["--set", "model.name=torchscript",
                                                             "--set", f"model.path={d}/lenet.pt"]),
            "builtin": lambda: limbo_rate(limbo, args, ["--set", "model.name=lenet"]),
            "mmap": lambda: limbo_rate(limbo, args, tensors + ["--set", "model.name=lenet"]),
        }
        print(f"LeNet, batch {args.batch}, {args.steps} steps, {args.threads} threads, SGD momentum 0.9; samples/s")
        print(f"{'repeat':>6} " + " ".join(f"{k:>9}" for k in contenders) +
              f" {'ts/best-pt':>11} {'ts/builtin':>11} {'mmap/builtin':>13}")
        runs = []
        for rep in range(args.repeats):
            r = {k: f() for k, f in contenders.items()}
            runs.append(r)
            print(f"{rep + 1:6d} " + " ".join(f"{r[k]:9.0f}" for k in contenders) +
                  f" {r['ts'] / max(r['pt-nchw'], r['pt-cl']):10.2f}x {r['ts'] / r['builtin']:10.2f}x"
                  f" {r['mmap'] / r['builtin']:12.2f}x", flush=True)
    # PyTorch's best setting is the memory format with the higher median;
    # each repeat's ratio is taken against that format's run in the same repeat.
    med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    best = max(("pt-nchw", "pt-cl"), key=lambda k: med([r[k] for r in runs]))
    ratios = {f"ts/{best}": [r["ts"] / r[best] for r in runs],
              "ts/builtin": [r["ts"] / r["builtin"] for r in runs],
              "mmap/builtin": [r["mmap"] / r["builtin"] for r in runs]}
    print(f"\nPyTorch at its best: {best} (median {med([r[best] for r in runs]):.0f} samples/s)")
    for name, rs in ratios.items():
        rs = sorted(rs)
        print(f"{name:13}: median {rs[len(rs) // 2]:.2f}x (range {rs[0]:.2f}-{rs[-1]:.2f}x, {len(rs)} repeats)")


if __name__ == "__main__":
    sys.exit(main())
