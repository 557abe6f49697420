#!/usr/bin/python3
"""Writes the GPT example's data and module.

Data: the bytes of Python's standard-library sources (present wherever
python3 is), 90 % for training and 10 % held out, cut into windows of
`--context` bytes at seeded random offsets: x = s[o : o+T] (int32 ids),
y = s[o+1 : o+T+1] (int64 next bytes), as train_x/train_y/test_x/test_y.npy.
Module: model.Gpt scripted (gpt.pt), its initial weights seeded.

Usage: prepare.py OUT [--context 64] [--train 40000] [--test 2000] [--seed 0]"""
import argparse
import glob
import os
import sys
import sysconfig

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import scripted  # noqa: E402


def corpus():
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    return np.frombuffer(b"".join(open(f, "rb").read() for f in files), dtype=np.uint8)


def windows(text, t, n, rng):
    starts = rng.integers(0, len(text) - t - 1, size=n)
    idx = starts[:, None] + np.arange(t + 1)[None]
    w = text[idx]
    return w[:, :t].astype(np.int32), w[:, 1:].astype(np.int64)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--train", type=int, default=40000)
    ap.add_argument("--test", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    text = corpus()
    cut = len(text) * 9 // 10
    rng = np.random.default_rng(a.seed)
    for split, part, n in (("train", text[:cut], a.train), ("test", text[cut:], a.test)):
        x, y = windows(part, a.context, n, rng)
        np.save(os.path.join(a.out, f"{split}_x.npy"), x)
        np.save(os.path.join(a.out, f"{split}_y.npy"), y)
    torch.jit.save(scripted(a.seed, context=a.context), os.path.join(a.out, "gpt.pt"))
    print(f"{len(text)} bytes of Python sources; {a.train} train and {a.test} held-out windows of "
          f"{a.context} bytes; module {os.path.join(a.out, 'gpt.pt')}")


if __name__ == "__main__":
    main()
