#!/usr/bin/python3
"""The AdamW step alone: Limbo's fused pass (limbo.Optimizer under a
one-process limbo.Job) against torch.optim.AdamW at its best here
(foreach=True and foreach=False, both run; the faster is the peer), on the
same parameters and gradients, one intra-op thread.

Models are lists of float32 matrices: "mlp10m" is the 784-2048-2048-2048-10
MLP's 10.2M parameters, "small" 0.2M (fits in the caches). Each contender
runs --steps steps per repeat (after 3 warm-up steps), the contenders
interleaved A, B, C, A, B, C, ...; prints each one's median ms a step with
its range, and the ratio of the peer's median to Limbo's.

    bench/optimizer_step.py [--models mlp10m,small] [--steps 20] [--repeats 5]

LIMBO_PYTHON_DIR picks the build of the module (default build/python), as
for an A/B of two builds.
"""
import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.environ.get("LIMBO_PYTHON_DIR", os.path.join(HERE, "..", "build", "python")))
import torch  # noqa: E402

SHAPES = {
    "mlp10m": [(2048, 784), (2048,), (2048, 2048), (2048,), (2048, 2048), (2048,), (10, 2048), (10,)],
    "small": [(256, 784), (256,)],
}


def params(shape_list, seed):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(*s, generator=g) * 0.02) for s in shape_list]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    return ps


class Model(torch.nn.Module):
    def __init__(self, ps):
        super().__init__()
        self.ps = torch.nn.ParameterList(ps)


def time_torch(shape_list, steps, foreach):
    ps = params(shape_list, 1)
    opt = torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, foreach=foreach)
    for _ in range(3):
        opt.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def time_limbo(shape_list, steps, run_dir):
    import limbo
    ps = params(shape_list, 1)
    grads = [p.grad.clone() for p in ps]
    model = Model(ps)
    n = steps + 3
    job = limbo.Job(model, limbo.Optimizer("adamw", lr=1e-3, weight_decay=0.1), dataset=n, batch_size=1,
                    max_steps=n, order="sequential", run_dir=run_dir, log_every=10 ** 9, checkpoint_every_epochs=0)
    times = []
    for i, _ in enumerate(job.batches(lambda ids: ids)):
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        job._core.backward_starts(0.0, job._rate())
        job._loss = 0.0
        t = time.perf_counter()
        job.step()
        if i >= 3:
            times.append(time.perf_counter() - t)
    job.finish()
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="mlp10m,small")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    import tempfile
    print("%-8s %-22s %12s %18s" % ("model", "contender", "ms a step", "range"))
    for m in a.models.split(","):
        shapes = SHAPES[m]
        runs = {"limbo": [], "torch foreach": [], "torch for-loop": []}
        for _ in range(a.repeats):
            with tempfile.TemporaryDirectory() as d:
                runs["limbo"].append(time_limbo(shapes, a.steps, d))
            runs["torch foreach"].append(time_torch(shapes, a.steps, True))
            runs["torch for-loop"].append(time_torch(shapes, a.steps, False))
        med = {k: statistics.median(v) for k, v in runs.items()}
        for k, v in runs.items():
            print("%-8s %-22s %12.2f %8.2f - %-7.2f" % (m, k, 1e3 * med[k], 1e3 * min(v), 1e3 * max(v)))
        best = min(med["torch foreach"], med["torch for-loop"])
        print("%-8s best torch / limbo: %.2fx" % (m, best / med["limbo"]))


if __name__ == "__main__":
    main()
