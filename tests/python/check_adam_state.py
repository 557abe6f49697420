#!/usr/bin/python3
"""Loads the AdamW state of a Limbo checkpoint into torch.optim.AdamW, makes
one step with a given gradient, and compares the weights with Limbo's next
step from the same checkpoint and gradient.

Usage: check_adam_state.py CHECKPOINT NAMES BIN LR BETA1 BETA2 EPS WD
NAMES lists the trainable parameters in the order of Limbo's flat buffer, one
per line. BIN holds float32: the gradient, then Limbo's weights after the
step (each over the flat buffer). Exit 0 and 'adamw state ok' on success."""
import sys

import torch


def main():
    ckpt_path, names_path, bin_path = sys.argv[1:4]
    lr, b1, b2, eps, wd = (float(v) for v in sys.argv[4:9])
    archive = torch.jit.load(ckpt_path)
    model = archive.model.state_dict()
    names = [n for n in open(names_path).read().split("\n") if n]
    algo = bytes(archive.optim.algorithm.tolist()).decode()
    assert algo == "adamw", algo
    step = int(archive.optim.step.item())
    exp_avg, exp_avg_sq = archive.optim.exp_avg, archive.optim.exp_avg_sq
    params = [torch.nn.Parameter(model[n].clone()) for n in names]
    total = sum(p.numel() for p in params)
    assert exp_avg.numel() == total and exp_avg_sq.numel() == total, (exp_avg.numel(), total)
    raw = torch.frombuffer(bytearray(open(bin_path, "rb").read()), dtype=torch.float32)
    assert raw.numel() == 2 * total
    grad, limbo_next = raw[:total], raw[total:]
    opt = torch.optim.AdamW(params, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    # The flat state, cut into the parameters' shapes: PyTorch's state_dict form.
    state, at = {}, 0
    for i, p in enumerate(params):
        k = p.numel()
        state[i] = {"step": torch.tensor(float(step)), "exp_avg": exp_avg[at:at + k].view_as(p).clone(),
                    "exp_avg_sq": exp_avg_sq[at:at + k].view_as(p).clone()}
        p.grad = grad[at:at + k].view_as(p).clone()
        at += k
    sd = opt.state_dict()
    sd["state"] = state
    opt.load_state_dict(sd)
    opt.step()
    mine = torch.cat([p.detach().reshape(-1) for p in params])
    diff = (mine - limbo_next).abs()
    bad = int((diff > 4 * 1.2e-7 * mine.abs() + 1e-7).sum().item())
    print(f"step {step} -> {step + 1}: {total} weights, max |diff| {diff.max().item():.3g}, {bad} beyond tolerance")
    if bad:
        sys.exit(1)
    print("adamw state ok")


if __name__ == "__main__":
    main()
