#!/usr/bin/python3
"""Sharded optimizer state (optim.shard_state) side by side with the
replicated path and with PyTorch's DDP, plain and with
ZeroRedundancyOptimizer (its ZeRO stage 1), interleaved run by run.

The GPT of examples/gpt (2 layers, width 128, context 64) with AdamW and
clipping at 1.0, 2 workers of 1 thread each, batch 32 per worker; each side
at its best precision (bf16 compute: Limbo's train.precision = bf16,
PyTorch's torch.autocast; float32 is run too and the faster kept by median).
Prints the median samples/s with its range, and the ratios (medians, ranges
over the repeats) of Limbo sharded against DDP at its best, DDP with
ZeroRedundancyOptimizer at its best, and Limbo replicated.

    bench/sharded_state.py [--limbo build/src/cli/limbo] [--repeats 3] [--gpt-data DIR]
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import precision  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limbo", default=os.path.join(precision.ROOT, "build/src/cli/limbo"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gpt-data", default=os.path.join(tempfile.gettempdir(), "limbo-gpt-stream"))
    a = ap.parse_args()
    limbo = os.path.abspath(a.limbo)
    if not os.path.exists(os.path.join(a.gpt_data, "gpt.pt")):
        subprocess.run([sys.executable, os.path.join(precision.ROOT, "examples/gpt/prepare.py"), a.gpt_data],
                       check=True)
    contenders = {
        "limbo sharded bf16": lambda s: precision.limbo_rate(limbo, "gpt", True, 2, a.gpt_data, shard=True, summary=s),
        "limbo replicated bf16": lambda s: precision.limbo_rate(limbo, "gpt", True, 2, a.gpt_data, summary=s),
        "ddp fp32": lambda s: precision.pytorch_rate("gpt", False, 2, a.gpt_data),
        "ddp bf16": lambda s: precision.pytorch_rate("gpt", True, 2, a.gpt_data),
        "ddp+zero fp32": lambda s: precision.pytorch_rate("gpt", False, 2, a.gpt_data, zero=True),
        "ddp+zero bf16": lambda s: precision.pytorch_rate("gpt", True, 2, a.gpt_data, zero=True),
    }
    got = {k: [] for k in contenders}
    summaries = {k: [] for k in contenders}
    for rep in range(a.repeats):
        for k, f in contenders.items():
            got[k].append(f(summaries[k]))
        print(f"  repeat {rep + 1}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in got.items()), flush=True)
    best = lambda keys: max(keys, key=lambda k: statistics.median(got[k]))
    ddp, zero = best(("ddp fp32", "ddp bf16")), best(("ddp+zero fp32", "ddp+zero bf16"))
    print(f"gpt, AdamW + clipping, 2 workers x 1 thread, batch 32 per worker; samples/s median (range) of {a.repeats}:")
    for k, v in got.items():
        print(f"  {k:22s} {precision.med(v)}")
    sh = got["limbo sharded bf16"]
    print(f"  Limbo sharded / DDP at its best ({ddp}):        {precision.ratio(sh, got[ddp])}")
    print(f"  Limbo sharded / DDP + ZeRO at its best ({zero}): {precision.ratio(sh, got[zero])}")
    print(f"  Limbo sharded / Limbo replicated:                 {precision.ratio(sh, got['limbo replicated bf16'])}")
    for k in ("limbo sharded bf16", "limbo replicated bf16"):
        c = [s.get("communication", {}) for s in summaries[k]]
        print(f"  {k}: update {statistics.median(x.get('update_ms_per_step', 0) for x in c):.2f} ms/step, "
              f"all-gather {statistics.median(x.get('all_gather_ms_per_step', 0) for x in c):.2f} ms/step, "
              f"exposed {statistics.median(x.get('exposed_communication_ms_per_step', 0) for x in c):.2f} ms/step")


if __name__ == "__main__":
    main()
