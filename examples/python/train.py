#!/usr/bin/env python3
"""Fashion-MNIST in a plain PyTorch loop, elastic under Limbo.

Alone (one process):
    PYTHONPATH=build/python python3 examples/python/train.py --run-dir runs/py
As the workers of an elastic job (members may come, go or crash):
    build/src/cli/limbo launch --nproc 2 --min-workers 1 --run-dir runs/py \\
        -- python3 examples/python/train.py

The model, the optimizer, the schedule, the data set and the loop are plain
PyTorch; the lines marked `# limbo` are all that Limbo adds.
"""
import argparse
import gzip
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import limbo  # limbo

DATA = "/usr/share/datasets/fashion-mnist"


def read_idx(path):
    with gzip.open(path, "rb") as f:
        raw = f.read()
    dims = raw[3]
    shape = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


class FashionMNIST(Dataset):
    """Images as float [1, 28, 28], standardised with the training split's mean and std."""

    def __init__(self, root, split, mean=None, std=None):
        prefix = "train" if split == "train" else "t10k"
        x = torch.from_numpy(read_idx("%s/%s-images-idx3-ubyte.gz" % (root, prefix)).copy()).float() / 255
        self.mean = float(x.mean()) if mean is None else mean
        self.std = float(x.std()) if std is None else std
        self.x = ((x - self.mean) / self.std).unsqueeze(1)
        self.y = torch.from_numpy(read_idx("%s/%s-labels-idx1-ubyte.gz" % (root, prefix)).astype(np.int64))

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class LeNet(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 20, 5)
        self.conv2 = nn.Conv2d(20, 50, 5)
        self.fc1 = nn.Linear(50 * 4 * 4, 500)
        self.fc2 = nn.Linear(500, classes)

    def forward(self, x):
        h = F.max_pool2d(self.conv1(x), 2)
        h = F.max_pool2d(self.conv2(h), 2)
        return self.fc2(F.relu(self.fc1(h.flatten(1))))


class MLP(nn.Module):
    def __init__(self, width=256, depth=2, classes=10):
        super().__init__()
        sizes = [28 * 28] + [width] * depth
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))
        self.out = nn.Linear(sizes[-1], classes)

    def forward(self, x):
        h = x.flatten(1)
        for layer in self.hidden:
            h = F.relu(layer(h))
        return self.out(h)


def sums(model):
    """What job.evaluate() adds up over the members' shares of the test set."""
    def of(batch):
        x, y = batch
        out = model(x)
        return {"loss": F.cross_entropy(out, y, reduction="sum"), "right": (out.argmax(1) == y).sum(), "n": len(y)}
    return of


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["lenet", "mlp"], default="lenet")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: none)")
    p.add_argument("--batch-size", type=int, default=64, help="per worker")
    p.add_argument("--lr", type=float, default=0.03)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--loader-workers", type=int, default=2, help="DataLoader worker processes")
    p.add_argument("--data", default=DATA)
    p.add_argument("--run-dir", default=None, help="default: the launcher's --run-dir (alone: none)")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()

    torch.manual_seed(args.seed)
    train = FashionMNIST(args.data, "train")
    test = FashionMNIST(args.data, "test", train.mean, train.std)
    model = LeNet() if args.model == "lenet" else MLP()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    steps = args.epochs * math.ceil(len(train) / args.batch_size)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))

    job = limbo.Job(model, opt, scheduler=sched, dataset=train, batch_size=args.batch_size,  # limbo
                    epochs=args.epochs, max_steps=args.max_steps, seed=args.seed, run_dir=args.run_dir)
    loader = DataLoader(train, batch_sampler=job.sampler, num_workers=args.loader_workers)  # limbo
    for x, y in job.batches(loader):  # limbo
        loss = F.cross_entropy(model(x), y)
        job.backward(loss)  # limbo
        if job.step() and job.epoch_ended:  # limbo
            m = job.evaluate(sums(model), test, batch_size=1000)  # limbo: each member its share
            job.record("eval", test_loss=m["loss"] / m["n"], test_accuracy=m["right"] / m["n"])
            if job.rank == 0:
                print("epoch %d: test accuracy %.2f%%" % (round(job.epoch), 100 * m["right"] / m["n"]), flush=True)
    m = job.evaluate(sums(model), test, batch_size=1000)  # limbo
    test_loss, acc = m["loss"] / m["n"], m["right"] / m["n"]
    summary = job.finish(test_loss=test_loss, test_accuracy=acc)  # limbo
    if summary is not None and job.is_writer:
        print("steps %d, test accuracy %.2f%% (test loss %.4f)" % (summary["steps"], 100 * acc, test_loss))


if __name__ == "__main__":
    main()
