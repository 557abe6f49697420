#!/usr/bin/env python3
"""The Python twin of a `limbo train` run (test_python_job.py): the module
that `limbo train` trains as TorchScript, here as a plain nn.Module with the
same weights, on the same npy files, the same order (seed 1), batch and
SGD, in a plain loop with the `limbo` module.

    cli_twin.py DATA_DIR MODEL_PT RUN_DIR
"""
import os
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import limbo


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(16, 32)
        self.out = nn.Linear(32, 4)

    def forward(self, x):
        return self.out(F.relu(self.hidden(x)))


def main():
    data, model_pt, run_dir = sys.argv[1:4]
    if len(sys.argv) > 4 and sys.argv[4] == "--write":  # the test's inputs: data and the scripted module
        rng = np.random.default_rng(0)
        x = rng.standard_normal((640, 16)).astype(np.float32)
        y = (x @ rng.standard_normal((16, 4))).argmax(1).astype(np.int64)
        os.makedirs(data, exist_ok=True)
        for split, sl in (("train", slice(0, 512)), ("test", slice(512, None))):
            np.save(os.path.join(data, "%s_x.npy" % split), x[sl])
            np.save(os.path.join(data, "%s_y.npy" % split), y[sl])
        torch.manual_seed(5)
        torch.jit.save(torch.jit.script(Net()), model_pt)
        return
    model = Net()
    model.load_state_dict(torch.jit.load(model_pt).state_dict())
    x = torch.from_numpy(np.load(os.path.join(data, "train_x.npy")))
    y = torch.from_numpy(np.load(os.path.join(data, "train_y.npy")))
    train = TensorDataset(x, y)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    job = limbo.Job(model, opt, dataset=train, batch_size=32, epochs=2, seed=1, run_dir=run_dir)
    for xb, yb in job.batches(DataLoader(train, batch_sampler=job.sampler)):
        job.backward(F.cross_entropy(model(xb), yb))
        job.step()
    job.finish()


if __name__ == "__main__":
    main()
