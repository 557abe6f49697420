"""A small decoder-like model trained with limbo.Optimizer under a given
sharding (shard="none" | "state" | "full"), for the fully sharded tests:
it writes each member's final weights (rank 0's file is the one compared)
and the steps' losses. Run under `limbo launch`."""
import argparse
import os
import signal
import sys

import torch
import torch.nn as nn

import limbo


def memory(field):
    """A field of /proc/self/status in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, h):
        return h + self.mlp(self.ln(h))


class Net(nn.Module):
    def __init__(self, vocab, width, blocks, buffer=False):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        # a float32 buffer (it lives in Limbo's flat region, beside the gradient)
        self.register_buffer("scale", torch.ones(width) if buffer else None)
        self.blocks = nn.ModuleList([Block(width) for _ in range(blocks)])
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, x):
        h = self.emb(x)
        if self.scale is not None:
            h = h * self.scale
        for b in self.blocks:
            h = b(h)
        return self.head(self.ln(h))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shard", default="full")
    ap.add_argument("--optimizer", default="adamw")
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=3)
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--clip", type=float, default=0.0)
    ap.add_argument("--nan-step", type=int, default=-1,
                    help="the member of --nan-rank makes its loss NaN after this many committed steps")
    ap.add_argument("--nan-rank", type=int, default=1)
    ap.add_argument("--die-step", type=int, default=-1,
                    help="the member of --die-rank SIGKILLs itself before the forward after this many steps; "
                         "each other member records its memory over that step and the one before")
    ap.add_argument("--die-rank", type=int, default=1)
    ap.add_argument("--watch-start", action="store_true",
                    help="record the growth of the peak resident set over the making of the job (a resume's load "
                         "and the group's first re-sharding)")
    ap.add_argument("--buffer", action="store_true", help="the model has a float32 buffer")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.manual_seed(0)
    vocab, context = 50, 16
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab, (args.samples, context), generator=g)
    y = (x * 7 + 3) % vocab  # a function of each token: learnable
    model = Net(vocab, args.width, args.blocks, args.buffer)
    if args.optimizer == "adamw":
        opt = limbo.Optimizer("adamw", lr=3e-3, weight_decay=0.01)
    else:
        opt = limbo.Optimizer("sgd", lr=0.05, momentum=0.9)
    if args.watch_start:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        start = memory("VmRSS")
    job = limbo.Job(model, opt, dataset=args.samples, batch_size=args.batch, epochs=args.epochs,
                    batch_policy="none", checkpoint_every_epochs=0, clip_grad_norm=args.clip, shard=args.shard)
    losses, held, middle, growth = [], [], None, {}
    if args.watch_start:  # the job made: a resume's load and the group's first re-sharding are in it
        growth["start"] = memory("VmHWM") - start
    for ids in job.batches(lambda ids: torch.as_tensor(ids)):
        watched = args.die_step > 0 and job.step_count in (args.die_step - 1, args.die_step)
        if watched:
            marker = os.path.join(args.out, "died")
            if job.step_count == args.die_step and job.rank == args.die_rank and not os.path.exists(marker):
                open(marker, "w").close()  # once: the group's next member of that rank goes on
                os.kill(os.getpid(), signal.SIGKILL)
            with open("/proc/self/clear_refs", "w") as f:  # the peak resident set starts again from now
                f.write("5")
            before = memory("VmRSS")
        out = model(x[ids])
        loss = nn.functional.cross_entropy(out.reshape(-1, vocab), y[ids].reshape(-1))
        hook = None
        if job.step_count == args.nan_step and job.rank == args.nan_rank:
            # One parameter's gradient on this member (the loss stays finite):
            # one shard of the sum is NaN, the step is skipped everywhere.
            hook = model.blocks[0].mlp[0].weight.register_hook(lambda g: g * float("nan"))
        job.backward(loss)
        if hook is not None:
            hook.remove()
        peak = memory("VmHWM") - before if watched else 0  # of the forward and backward
        committed = job.step()  # (a failed step's re-formation is in it, and the step is dealt again)
        if watched and not committed:
            growth.setdefault("failed", peak)
        elif watched and job.step_count == args.die_step:
            growth["committed"] = peak
        if committed:
            losses.append(job.loss)
            # What a unit's weights read between steps: zeros where this
            # member does not hold them (shard="full").
            w = model.blocks[args.blocks // 2].mlp[0].weight
            held.append(float((w != 0).float().mean()))
            if job.step_count == 5:  # the whole model in the middle of training
                middle = job.full_state_dict()
    job.finish()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.save({"weights": weights, "losses": losses, "world": job.world,
                "held": held, "middle": middle, "growth": growth,
                "params": sum(p.numel() for p in model.parameters())},
               os.path.join(args.out, "rank%d.pt" % job.rank))


if __name__ == "__main__":
    sys.exit(main())
