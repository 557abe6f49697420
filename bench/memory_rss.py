#!/usr/bin/python3
"""Peak memory of the default job: `limbo train --config configs/default.toml`
against PyTorch for Python doing the same.

Both train LeNet on Fashion-MNIST (all 60k training images, batch 64, SGD
with momentum 0.9, lr 0.03 on a cosine schedule, 2 threads) for --epochs
epochs and evaluate on the 10k test images after each. PyTorch runs at its
leanest: the images stay uint8 in memory and each batch is converted and
normalised as it is drawn (as Limbo does), with no DataLoader worker
processes, evaluation in chunks of 64 under no_grad (as Limbo's). The peak resident set
of the whole process (code, libraries, data, heap) is the kernel's ru_maxrss
of each child. Contenders run interleaved (Limbo, PyTorch, Limbo, ...),
--repeats times; prints each run, the medians and the ratio's median and
range.

    bench/memory_rss.py [--limbo build/src/cli/limbo] [--epochs 1] [--repeats 3]
"""
import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

FMNIST = "/usr/share/datasets/fashion-mnist"
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def torch_job(epochs):
    import numpy as np
    import torch
    import torch.nn.functional as F
    sys.path.insert(0, HERE)
    from train_throughput import LeNet

    torch.set_num_threads(2)
    torch.manual_seed(1)

    def idx(name, offset, shape):
        with gzip.open(os.path.join(FMNIST, name)) as f:
            return torch.from_numpy(np.frombuffer(f.read(), np.uint8, offset=offset).copy()).view(*shape)

    xtr = idx("train-images-idx3-ubyte.gz", 16, (-1, 1, 28, 28))
    ytr = idx("train-labels-idx1-ubyte.gz", 8, (-1,)).long()
    xte = idx("t10k-images-idx3-ubyte.gz", 16, (-1, 1, 28, 28))
    yte = idx("t10k-labels-idx1-ubyte.gz", 8, (-1,)).long()
    # The training split's mean and std, in chunks (no float copy of the split).
    s1 = s2 = 0.0
    for c in xtr.split(10000):
        f = c.double() / 255.0
        s1 += f.sum().item()
        s2 += (f * f).sum().item()
    mean = s1 / xtr.numel()
    std = (s2 / xtr.numel() - mean * mean) ** 0.5

    def batch(x, ids):
        return (x[ids].float() / 255.0 - mean) / std

    model = LeNet()
    steps = epochs * (len(ytr) // 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.03, momentum=0.9)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    for _ in range(epochs):
        model.train()
        perm = torch.randperm(len(ytr))
        for s in range(len(ytr) // 64):
            ids = perm[s * 64:(s + 1) * 64]
            loss = F.cross_entropy(model(batch(xtr, ids)), ytr[ids])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        model.eval()
        correct = 0
        with torch.no_grad():
            for s in range(0, len(yte), 64):
                ids = torch.arange(s, min(s + 64, len(yte)))
                correct += (model(batch(xte, ids)).argmax(1) == yte[ids]).sum().item()
        print(json.dumps({"test_accuracy": correct / len(yte)}), flush=True)


def peak_of(cmd):
    """Runs cmd; returns (peak RSS in MiB, wall seconds, its stdout)."""
    t0 = time.time()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    out = p.stdout.read()
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise RuntimeError(f"{cmd[0]} exited with {p.returncode}")
    return usage.ru_maxrss / 1024.0, time.time() - t0, out


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--torch-job":
        torch_job(int(sys.argv[2]))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limbo", default=os.path.join(ROOT, "build/src/cli/limbo"))
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"default job (LeNet, Fashion-MNIST, batch 64, 2 threads), {args.epochs} epoch(s), "
          f"peak RSS of the whole process, {args.repeats} interleaved repeats", flush=True)
    runs = {"limbo": [], "torch": []}
    with tempfile.TemporaryDirectory(prefix="limbo-rss-") as d:
        for i in range(args.repeats):
            rss, secs, _ = peak_of([args.limbo, "train", "--config", os.path.join(ROOT, "configs/default.toml"),
                                    "--set", f"train.epochs={args.epochs}", "--set", "train.threads=2",
                                    "--set", "train.progress=false", "--run-dir", os.path.join(d, f"r{i}")])
            runs["limbo"].append(rss)
            print(f"  limbo   {rss:7.1f} MiB  ({secs:.0f} s)", flush=True)
            rss, secs, out = peak_of([sys.executable, __file__, "--torch-job", str(args.epochs)])
            runs["torch"].append(rss)
            acc = json.loads(out.strip().splitlines()[-1])["test_accuracy"]
            print(f"  pytorch {rss:7.1f} MiB  ({secs:.0f} s, test accuracy {100 * acc:.2f}%)", flush=True)
    r = [a / b for a, b in zip(runs["limbo"], runs["torch"])]
    print(f"median peak RSS: limbo {statistics.median(runs['limbo']):.1f} MiB, "
          f"pytorch {statistics.median(runs['torch']):.1f} MiB; "
          f"limbo / pytorch {statistics.median(r):.2f}x ({min(r):.2f}-{max(r):.2f})")


if __name__ == "__main__":
    main()
