"""Prints a TorchScript module's parameters and buffers as JSON: for each
name its dtype, requires_grad, float64 sum, a hash of its bytes, and its
values when it has at most 16 elements. Tests compare a user's module with
what Limbo exported after training it.

usage: module_state.py MODULE.pt
"""
import hashlib
import json
import sys

import torch


def describe(t, requires_grad):
    t = t.detach().contiguous()
    d = {"dtype": str(t.dtype).replace("torch.", ""), "requires_grad": requires_grad,
         "sum": float(t.double().sum()), "hash": hashlib.sha1(t.numpy().tobytes()).hexdigest()}
    if t.numel() <= 16:
        d["values"] = t.double().reshape(-1).tolist()
    return d


def main():
    m = torch.jit.load(sys.argv[1])
    out = {"parameters": {n: describe(p, p.requires_grad) for n, p in m.named_parameters()},
           "buffers": {n: describe(b, False) for n, b in m.named_buffers()}}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
