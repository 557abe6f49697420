#!/usr/bin/env python3
"""Writes the models and datasets the TorchScript tests train, the way a user
would: modules saved with torch.jit.save, arrays with np.save or as
safetensors.

usage: make_fixtures.py OUT_DIR [--train N] [--test N]

OUT_DIR/
  fmnist_npy/          train_x.npy (uint8 [N,1,28,28]), train_y.npy (int64), test_*
  fmnist_st/           train.safetensors, test.safetensors (x float16 [N,28,28], y int32)
  regress_npy/         x float32 [N,8], y float32 [N,2] (a noisy linear map)
  tokens_npy/          x float32 [N,12,6], y int64 [N,12]: per-token labels (argmax of 4 features)
  cnn_bn.pt            small CNN with BatchNorm and dropout (scripted)
  gru_rows.pt          GRU reading the image rows, classifier on the last state (scripted)
  module_loss.pt       forward(x, y) returns the loss; predict(x) returns scores
  regress.pt           two-layer regression net (traced), for model.loss = mse
  five_classes.pt      a classifier with only 5 outputs (labels go to 9)
  tagger.pt            per-token classifier: [B, T, 6] -> scores [B, 4, T]
  stops_moving.pt      a classifier with a block that trains only in its first 40 calls
"""
import argparse
import gzip
import json
import os
import struct

import numpy as np
import torch
from torch import nn

FMNIST = "/usr/share/datasets/fashion-mnist"


def idx(path):
    with gzip.open(path) as f:
        data = f.read()
    nd = data[3]
    dims = struct.unpack(">" + "I" * nd, data[4:4 + 4 * nd])
    return np.frombuffer(data[4 + 4 * nd:], np.uint8).reshape(dims)


def save_safetensors(path, tensors):
    codes = {np.dtype(np.float16): "F16", np.dtype(np.float32): "F32", np.dtype(np.int32): "I32",
             np.dtype(np.int64): "I64", np.dtype(np.uint8): "U8"}
    header, blobs, offset = {}, [], 0
    for name, a in tensors.items():
        a = np.ascontiguousarray(a)
        b = a.tobytes()
        header[name] = {"dtype": codes[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


class CnnBn(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 12, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(12)
        self.conv2 = nn.Conv2d(12, 24, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(24)
        self.drop = nn.Dropout(0.3)
        self.head = nn.Linear(24 * 7 * 7, classes)

    def forward(self, x):
        x = torch.max_pool2d(torch.relu(self.bn1(self.conv1(x))), 2)
        x = torch.max_pool2d(torch.relu(self.bn2(self.conv2(x))), 2)
        return self.head(self.drop(torch.flatten(x, 1)))


class FrozenBackbone(CnnBn):
    """CnnBn whose first convolution and BatchNorm are a frozen backbone:
    only conv2, bn2 and the head train (BatchNorm statistics still move)."""

    def __init__(self):
        super().__init__()
        for p in list(self.conv1.parameters()) + list(self.bn1.parameters()):
            p.requires_grad_(False)


class Buffers(nn.Module):
    """Buffers of every kind a user may keep: a BatchNorm with a cumulative
    average (momentum=None, driven by its int64 num_batches_tracked), and
    float64, float16, int32 and bool buffers that forward updates."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8, momentum=None)
        self.head = nn.Linear(8 * 14 * 14, 10)
        self.register_buffer("seen", torch.zeros(1, dtype=torch.float64))
        self.register_buffer("mean16", torch.zeros(8, dtype=torch.float16))
        self.register_buffer("calls", torch.zeros(1, dtype=torch.int32))
        self.register_buffer("active", torch.zeros(8, dtype=torch.bool))

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x)))
        if self.training:
            m = h.detach().mean(dim=[0, 2, 3])
            self.seen += x.shape[0]
            self.mean16.copy_((0.9 * self.mean16.float() + 0.1 * m).half())
            self.calls += 1
            self.active.copy_(m > m.median())
        return self.head(torch.flatten(torch.max_pool2d(h, 2), 1))


class StopsMoving(nn.Module):
    """A linear classifier with a second weight matrix, `late` (7,840
    values: whole quantisation blocks), that trains only in its first 40
    forward calls in training (counted by an int64 buffer) and gets an
    exactly zero gradient after: under DiLoCo its pseudo-gradient stops
    moving, as a dead unit's rows or the embeddings of tokens no longer seen
    do."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(28 * 28, 10)
        self.late = nn.Parameter(torch.zeros(28 * 28, 10))
        self.register_buffer("calls", torch.zeros(1, dtype=torch.int64))

    def forward(self, x):
        x = torch.flatten(x, 1)
        out = self.body(x)
        if self.training:
            self.calls += 1
            if int(self.calls.item()) <= 40:
                out = out + x @ self.late
        else:
            out = out + x @ self.late
        return out


class GruRows(nn.Module):
    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(28, 48, batch_first=True)
        self.out = nn.Linear(48, 10)

    def forward(self, x):
        h, _ = self.gru(x.reshape(x.shape[0], 28, 28))
        return self.out(h[:, -1])


class ModuleLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(784, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x, y):
        scores = self.body(x)
        # label smoothing: a loss the built-in choices do not offer
        return nn.functional.cross_entropy(scores, y, label_smoothing=0.1)

    @torch.jit.export
    def predict(self, x):
        return self.body(x)


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 32)
        self.out = nn.Linear(32, 4)

    def forward(self, x):
        return self.out(torch.relu(self.proj(x))).permute(0, 2, 1)


class NanTail(nn.Module):
    """Its loss is finite, but the gradient of its last parameter is NaN
    (the backward of sqrt at 0 through a branch torch.where discards):
    a gradient that is not finite in one slice only."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(784, 10))
        self.tail = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        out = self.body(x)
        return out + torch.where(out > 1e30, torch.sqrt(self.tail), torch.zeros(1))


class ByteLM(nn.Module):
    """A byte-level next-byte model over an embedding: what a new user of a
    language model brings (int ids in, scores [B, 256, T] out)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(256, 24)
        self.mix = nn.Conv1d(24, 48, 3, padding=2)  # sees the byte and the two before it
        self.out = nn.Linear(48, 256)

    def forward(self, x):
        h = self.emb(x).transpose(1, 2)              # [B, 24, T]
        h = torch.relu(self.mix(h)[:, :, : x.shape[1]])  # causal: drop the look-ahead
        return self.out(h.transpose(1, 2)).transpose(1, 2)  # [B, 256, T]


def byte_windows(text, t, n, rng):
    starts = rng.integers(0, len(text) - t - 1, size=n)
    x = np.stack([text[s : s + t] for s in starts])
    y = np.stack([text[s + 1 : s + t + 1] for s in starts])
    return x, y


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--train", type=int, default=6000)
    ap.add_argument("--test", type=int, default=1000)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    torch.manual_seed(0)

    xtr = idx(f"{FMNIST}/train-images-idx3-ubyte.gz")[:a.train]
    ytr = idx(f"{FMNIST}/train-labels-idx1-ubyte.gz")[:a.train].astype(np.int64)
    xte = idx(f"{FMNIST}/t10k-images-idx3-ubyte.gz")[:a.test]
    yte = idx(f"{FMNIST}/t10k-labels-idx1-ubyte.gz")[:a.test].astype(np.int64)

    d = os.path.join(a.out, "fmnist_npy")
    os.makedirs(d, exist_ok=True)
    np.save(f"{d}/train_x.npy", xtr[:, None])
    np.save(f"{d}/train_y.npy", ytr)
    np.save(f"{d}/test_x.npy", xte[:, None])
    np.save(f"{d}/test_y.npy", yte)

    d = os.path.join(a.out, "fmnist_st")
    os.makedirs(d, exist_ok=True)
    save_safetensors(f"{d}/train.safetensors", {"x": (xtr / 255.0).astype(np.float16), "y": ytr.astype(np.int32)})
    save_safetensors(f"{d}/test.safetensors", {"x": (xte / 255.0).astype(np.float16), "y": yte.astype(np.int32)})

    rng = np.random.default_rng(0)
    w = rng.normal(size=(8, 2)).astype(np.float32)
    d = os.path.join(a.out, "regress_npy")
    os.makedirs(d, exist_ok=True)
    for split, n in (("train", 2000), ("test", 500)):
        x = rng.normal(size=(n, 8)).astype(np.float32)
        y = (x @ w + 0.05 * rng.normal(size=(n, 2))).astype(np.float32)
        np.save(f"{d}/{split}_x.npy", x)
        np.save(f"{d}/{split}_y.npy", y)

    d = os.path.join(a.out, "tokens_npy")
    os.makedirs(d, exist_ok=True)
    for split, n in (("train", 2000), ("test", 500)):
        x = rng.normal(size=(n, 12, 6)).astype(np.float32)
        np.save(f"{d}/{split}_x.npy", x)
        np.save(f"{d}/{split}_y.npy", x[:, :, :4].argmax(-1).astype(np.int64))

    # Text as bytes (a licence every Debian system ships): windows of 32
    # byte ids as int32, each target the next byte (int64). Bytes 0-31 but
    # the newline never occur, so labels have gaps below their largest.
    text = np.frombuffer(open("/usr/share/common-licenses/GPL-3", "rb").read(), dtype=np.uint8)
    cut = len(text) * 9 // 10
    d = os.path.join(a.out, "bytes_npy")
    os.makedirs(d, exist_ok=True)
    for split, part, n in (("train", text[:cut], 3000), ("test", text[cut:], 300)):
        x, y = byte_windows(part, 32, n, rng)
        np.save(f"{d}/{split}_x.npy", x.astype(np.int32))
        np.save(f"{d}/{split}_y.npy", y.astype(np.int64))
    # The same text as token streams (data.dataset = "tokens"): one 1-D
    # array per split, cut into windows by Limbo. uint16 for training (the
    # dtype of most tokenizers' ids), three int32 shards for validation.
    d = os.path.join(a.out, "bytes_stream")
    os.makedirs(d, exist_ok=True)
    np.save(f"{d}/train.npy", text[:cut].astype(np.uint16))
    val = text[cut:].astype(np.int32)
    for k, part in enumerate(np.array_split(val, 3)):
        np.save(f"{d}/val-{k:05d}-of-00003.npy", part)
    torch.jit.save(torch.jit.script(ByteLM()), f"{a.out}/byte_lm.pt")
    torch.jit.save(torch.jit.script(NanTail()), f"{a.out}/nan_tail.pt")

    torch.jit.save(torch.jit.script(Tagger()), f"{a.out}/tagger.pt")
    torch.jit.save(torch.jit.script(CnnBn()), f"{a.out}/cnn_bn.pt")
    torch.jit.save(torch.jit.script(GruRows()), f"{a.out}/gru_rows.pt")
    torch.jit.save(torch.jit.script(ModuleLoss()), f"{a.out}/module_loss.pt")
    torch.jit.save(torch.jit.script(CnnBn(5)), f"{a.out}/five_classes.pt")
    torch.jit.save(torch.jit.script(FrozenBackbone()), f"{a.out}/frozen_backbone.pt")
    torch.jit.save(torch.jit.script(Buffers()), f"{a.out}/buffers.pt")
    torch.jit.save(torch.jit.script(StopsMoving()), f"{a.out}/stops_moving.pt")

    # The same Fashion-MNIST split into shards of uneven sizes, as published
    # data sets arrive: 16 safetensors shards of train (test in 3), and the
    # same as numpy pairs.
    cuts = sorted(rng.choice(np.arange(1, a.train), 15, replace=False))
    test_cuts = [a.test // 3, 2 * a.test // 3]
    d = os.path.join(a.out, "fmnist_shards_st")
    os.makedirs(d, exist_ok=True)
    for split, x, y, c in (("train", xtr, ytr, cuts), ("test", xte, yte, test_cuts)):
        parts = list(zip(np.split(x[:, None], c), np.split(y, c)))
        for k, (px, py) in enumerate(parts):
            save_safetensors(f"{d}/{split}-{k:05d}-of-{len(parts):05d}.safetensors", {"x": px, "y": py})
    d = os.path.join(a.out, "fmnist_shards_npy")
    os.makedirs(d, exist_ok=True)
    for split, x, y, c in (("train", xtr, ytr, cuts), ("test", xte, yte, test_cuts)):
        for k, (px, py) in enumerate(zip(np.split(x[:, None], c), np.split(y, c))):
            np.save(f"{d}/{split}_x-{k:05d}.npy", px)
            np.save(f"{d}/{split}_y-{k:05d}.npy", py)

    # Fashion-MNIST as float32 with a few samples that are NaN (a damaged
    # file): their batches' gradients are not finite.
    d = os.path.join(a.out, "fmnist_nan_npy")
    os.makedirs(d, exist_ok=True)
    xbad = (xtr[:, None] / 255.0).astype(np.float32)
    xbad[[n * a.train // 60 for n in (1, 25, 40)]] = np.nan  # samples 100, 2500, 4000 of 6000
    np.save(f"{d}/train_x.npy", xbad)
    np.save(f"{d}/train_y.npy", ytr)
    np.save(f"{d}/test_x.npy", (xte[:, None] / 255.0).astype(np.float32))
    np.save(f"{d}/test_y.npy", yte)
    reg = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2))
    torch.jit.save(torch.jit.trace(reg, torch.zeros(4, 8)), f"{a.out}/regress.pt")


if __name__ == "__main__":
    main()
