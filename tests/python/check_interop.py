#!/usr/bin/python3
"""Reads a Limbo checkpoint with torch.jit.load and a Limbo safetensors export
with an independent parser of the format, and checks they hold the same
tensors. Exit 0 and 'interop ok' on success."""
import json
import struct
import sys

import torch

DTYPES = {"F32": torch.float32, "F64": torch.float64, "I64": torch.int64, "I32": torch.int32,
          "U8": torch.uint8}


def read_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0, "header length must be 8-byte aligned"
    header = json.loads(raw[8:8 + n])
    body = raw[8 + n:]
    out, end = {}, 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        assert b == end, f"{name}: tensors must be contiguous and in order"
        end = e
        t = torch.frombuffer(bytearray(body[b:e]), dtype=DTYPES[info["dtype"]])
        out[name] = t.reshape(info["shape"])
    assert end == len(body), "trailing bytes after the last tensor"
    return out, header.get("__metadata__", {})


def main(ckpt, st):
    archive = torch.jit.load(ckpt)
    model = archive.model.state_dict()
    step = int(archive.state.step.item())
    tensors, meta = read_safetensors(st)
    assert meta.get("format") == "pt", meta
    assert set(model) == set(tensors), (sorted(model), sorted(tensors))
    for k, v in model.items():
        assert torch.equal(v, tensors[k]), k
    print(f"interop ok: {len(model)} tensors, step {step}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
