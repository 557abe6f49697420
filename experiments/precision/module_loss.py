#!/usr/bin/python3
"""Where a module's own loss (model.loss = module) is computed under bf16
autocast on the CPU (docs/precision.md; fourth fault review, S3).

The same libtorch runs Limbo's TorchScript modules, so PyTorch for Python's
CPU autocast is the oracle: a linear layer's logits come out in bf16, and
each loss is computed on them inside autocast, then again in float32 on the
same logits. Prints the loss's dtype and both values.

    experiments/precision/module_loss.py
"""
import torch
import torch.nn.functional as F


class ModuleLoss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(100, 10)

    def forward(self, x, y):
        return F.cross_entropy(self.lin(x), y)


def main():
    torch.manual_seed(0)
    x, y = torch.randn(64, 100), torch.randint(0, 10, (64,))
    lin = torch.nn.Linear(100, 10)
    losses = {
        "F.cross_entropy": lambda z: F.cross_entropy(z, y),
        "F.mse_loss": lambda z: F.mse_loss(z, torch.zeros_like(z)),
        "F.nll_loss(F.log_softmax)": lambda z: F.nll_loss(F.log_softmax(z, 1), y),
        "hand-written (z * z).mean()": lambda z: (z * z).mean(),
    }
    print("| loss in the module | logits | loss dtype | under autocast | float32 on the same logits |")
    print("| --- | --- | --- | --- | --- |")
    for name, f in losses.items():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            z = lin(x)
            loss = f(z)
        print(f"| {name} | {z.dtype} | {loss.dtype} | {loss.item():.6f} | {f(z.float()).item():.6f} |")
    m = torch.jit.script(ModuleLoss())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = m(x, y)
    print(f"\nA scripted module returning F.cross_entropy under autocast: {loss.dtype}")


if __name__ == "__main__":
    main()
