#!/usr/bin/env python3
"""A worker for the signal tests (test_python_job.py): a small elastic job,
then what the mode asks.

  after OUT   after job.finish(): writes "ready PID", sleeps 60 s; Ctrl-C must
              interrupt the sleep at once ("interrupted"), as in plain Python
  fork OUT    forks after the job installed its handlers: the child raises
              SIGINT and must get KeyboardInterrupt (a DataLoader worker's
              handlers are those of before the job); writes "child CODE"
  wait OUT    writes "waiting PID", then limbo.Job(...) waits for a group that
              cannot form (the launcher's --min-workers is not met): Ctrl-C
              must end that wait at once, as KeyboardInterrupt ("interrupted")
  own OUT     the user's own SIGTERM handler, installed before the job, must
              still run when SIGTERM arrives ("own handler"); the job also
              leaves at the next step (the launcher's checkpoint and exit code)
"""
import os
import signal
import sys
import time

import torch

import limbo

mode, out = sys.argv[1], sys.argv[2]
if mode == "own":
    signal.signal(signal.SIGTERM, lambda s, f: open(out, "a").write("own handler\n"))
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = [(torch.randn(4), 0)] * 64
if mode == "wait":
    with open(out, "w") as f:
        f.write("waiting %d\n" % os.getpid())
    try:
        limbo.Job(model, opt, dataset=data, batch_size=4)
        open(out, "a").write("formed\n")
    except KeyboardInterrupt:
        open(out, "a").write("interrupted\n")
    sys.exit(0)
job = limbo.Job(model, opt, dataset=data, batch_size=4, epochs=10000 if mode == "own" else 1)
if mode == "fork":
    pid = os.fork()
    if pid == 0:
        try:
            signal.raise_signal(signal.SIGINT)
            time.sleep(2)
            os._exit(3)
        except KeyboardInterrupt:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    with open(out, "w") as f:
        f.write("child %d\n" % os.waitstatus_to_exitcode(status))
for x, y in job.batches(torch.utils.data.DataLoader(data, batch_sampler=job.sampler)):
    job.backward(torch.nn.functional.cross_entropy(model(x), y))
    if job.step() and mode == "own" and job.step_count == 1:
        open(out, "a").write("training\n")
    if mode == "own":
        time.sleep(0.01)
job.finish()
if mode == "after":
    with open(out, "w") as f:
        f.write("ready %d\n" % os.getpid())
    try:
        time.sleep(60)
        open(out, "a").write("slept\n")
    except KeyboardInterrupt:
        open(out, "a").write("interrupted\n")
