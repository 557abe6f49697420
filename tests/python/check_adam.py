#!/usr/bin/python3
"""Replays recorded gradients through torch.optim.Adam or AdamW and compares
the weights after each step with Limbo's.

Usage: check_adam.py FILE ALGORITHM N STEPS LR BETA1 BETA2 EPS WD
FILE holds float32: the initial weights (N), STEPS gradients (N each) and
Limbo's weights after each step (STEPS x N). Prints the largest absolute and
relative differences; exit 0 when every weight is within 4 float32 ulps of
its magnitude plus 1e-7."""
import sys

import torch


def main():
    path, algo = sys.argv[1], sys.argv[2]
    n, steps = int(sys.argv[3]), int(sys.argv[4])
    lr, b1, b2, eps, wd = (float(v) for v in sys.argv[5:10])
    raw = torch.frombuffer(bytearray(open(path, "rb").read()), dtype=torch.float32)
    assert raw.numel() == n * (1 + 2 * steps), (raw.numel(), n, steps)
    w0 = raw[:n].clone()
    grads = raw[n:n + steps * n].view(steps, n)
    limbo = raw[n + steps * n:].view(steps, n)
    p = torch.nn.Parameter(w0.clone())
    cls = torch.optim.AdamW if algo == "adamw" else torch.optim.Adam
    opt = cls([p], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    worst_abs, worst_rel, bad = 0.0, 0.0, 0
    for t in range(steps):
        p.grad = grads[t].clone()
        opt.step()
        diff = (p.detach() - limbo[t]).abs()
        scale = p.detach().abs()
        worst_abs = max(worst_abs, diff.max().item())
        worst_rel = max(worst_rel, (diff / scale.clamp_min(1e-30)).max().item())
        bad += int((diff > 4 * 1.2e-7 * scale + 1e-7).sum().item())
    print(f"{algo}: {steps} steps of {n} weights; max |diff| {worst_abs:.3g}, max relative {worst_rel:.3g}, "
          f"{bad} beyond tolerance")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
