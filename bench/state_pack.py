#!/usr/bin/python3
"""What moving a Python loop's own state costs at a re-formation: the
user's AdamW state (after one step), scheduler and `state` dict packed as
limbo.Job packs them (torch.save into memory) on the member everyone takes
the state from, and unpacked on each other member (torch.load, then the
optimizer's load_state_dict). With sync="step" a re-formation now moves
these bytes only to members that are behind or new: survivors that took
part in every committed step skip both (and the broadcast between them).

    bench/state_pack.py [--models charlm-s,charlm-m,charlm-l] [--repeats 5]

Prints, per model, the parameters, the packed bytes, and the median (with
range) of pack and unpack in milliseconds.
"""
import argparse
import io
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import charlm  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="charlm-s,charlm-m,charlm-l")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("%-9s %11s %11s %22s %22s" % ("model", "parameters", "packed MB", "pack ms (range)", "unpack ms (range)"))
    for name in args.models.split(","):
        _, model, _ = charlm.data_and_model(name)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
        sched.step()
        packs, unpacks, size = [], [], 0
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            buf = io.BytesIO()
            torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "state": {"step": 1}}, buf)
            data = buf.getbuffer()
            t1 = time.perf_counter()
            saved = torch.load(io.BytesIO(bytes(data)))
            opt.load_state_dict(saved["optimizer"])
            sched.load_state_dict(saved["scheduler"])
            t2 = time.perf_counter()
            packs.append(1e3 * (t1 - t0))
            unpacks.append(1e3 * (t2 - t1))
            size = len(data)
        n = sum(p.numel() for p in model.parameters())
        print("%-9s %11d %11.1f %22s %22s" % (
            name, n, size / 1e6,
            "%.1f (%.1f-%.1f)" % (statistics.median(packs), min(packs), max(packs)),
            "%.1f (%.1f-%.1f)" % (statistics.median(unpacks), min(unpacks), max(unpacks))), flush=True)


if __name__ == "__main__":
    main()
