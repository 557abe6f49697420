#!/usr/bin/python3
"""Writes the GPT example's data and module.

Data: a byte-level corpus as token streams (data.dataset = "tokens"), 95 %
for training in --shards npy shards (train-00000-of-0000N.npy ...) and 5 %
held out (val.npy), one uint8 id per byte. The corpus is the King James
Bible of Debian's bible-kjv-text package (`bible` prints it; the package is
installed by examples/gpt/setup.sh), or with --corpus python the bytes of
Python's standard-library sources (present wherever python3 is).
--windows N also writes N hand-cut training windows (and N/20 held out) as
train_x/train_y/test_x/test_y.npy at seeded offsets, the tensor-dataset
form of examples/gpt/compare.py and experiments/adam_scaling.
Module: model.Gpt scripted (gpt.pt), its initial weights seeded.

Usage: prepare.py OUT [--corpus bible|python] [--context 64] [--shards 4] [--seed 0] [--windows N]"""
import argparse
import glob
import os
import subprocess
import sys
import sysconfig

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import scripted  # noqa: E402


def corpus(name):
    if name == "python":
        files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
        return np.frombuffer(b"".join(open(f, "rb").read() for f in files), dtype=np.uint8)
    try:
        text = subprocess.run(["bible", "Gen1:1-Rev22:21"], check=True, capture_output=True).stdout
    except FileNotFoundError:
        sys.exit("prepare.py: the `bible` command is missing: run examples/gpt/setup.sh "
                 "(apt-get install bible-kjv-text), or use --corpus python")
    return np.frombuffer(text, dtype=np.uint8)


def windows(text, t, n, rng):
    starts = rng.integers(0, len(text) - t - 1, size=n)
    idx = starts[:, None] + np.arange(t + 1)[None]
    w = text[idx]
    return w[:, :t].astype(np.int32), w[:, 1:].astype(np.int64)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--corpus", choices=["bible", "python"], default="bible")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--windows", type=int, default=0)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    text = corpus(a.corpus)
    cut = len(text) * 19 // 20 if a.windows == 0 else len(text) * 9 // 10
    train, val = text[:cut], text[cut:]
    for k, part in enumerate(np.array_split(train, a.shards)):
        np.save(os.path.join(a.out, f"train-{k:05d}-of-{a.shards:05d}.npy"), part)
    np.save(os.path.join(a.out, "val.npy"), val)
    if a.windows > 0:
        rng = np.random.default_rng(a.seed)
        for split, part, n in (("train", train, a.windows), ("test", val, max(1, a.windows // 20))):
            x, y = windows(part, a.context, n, rng)
            np.save(os.path.join(a.out, f"{split}_x.npy"), x)
            np.save(os.path.join(a.out, f"{split}_y.npy"), y)
    torch.jit.save(scripted(a.seed, context=a.context), os.path.join(a.out, "gpt.pt"))
    print(f"{len(text)} bytes of {a.corpus} text: {len(train)} for training in {a.shards} shards, "
          f"{len(val)} held out (val.npy); module {os.path.join(a.out, 'gpt.pt')}")


if __name__ == "__main__":
    main()
