#!/usr/bin/env python3
"""A user's training loop for the Python module's tests (test_python_job.py).

Plain PyTorch the way users write it: a model that TorchScript cannot
compile (a dict of tensors in, Python control flow and a Python helper), a
map-style Dataset that yields dicts, a DataLoader with worker processes, any
torch.optim optimizer with a LambdaLR schedule, metrics of its own.

What the tests read, in the run directory:
  samples-PID.txt  one line per step this member committed: "step epoch id id ..."
                   (the step's global batch, every member's ids)
  final-PID.txt    the final step and fingerprints of the weights, the buffers
                   and the optimizer's state and step count
Faults, from the environment (once, in the first process of that rank):
  DIE_AT_STEP, DIE_RANK   after this many committed steps, the member of this rank
  DIE_HOW                 kill (SIGKILL) | stop (SIGSTOP)
  DIE_WHERE               before_forward | before_backward | before_step | after_step |
                          commit_logged | commit_barrier1 | commit_update (inside job.step(),
                          fully sharded: Limbo's testing aid LIMBO_TESTING_DIE_IN_COMMIT)
  PACE                    seconds each step sleeps (time for joins and kills)
  PACE_UNTIL              ... only while the group has fewer members than this
Habits (--habit), the ways DDP scripts are written:
  job-backward    job.backward(loss) (the documented way)
  plain-backward  optimizer.zero_grad(); loss.backward()
  set-to-none     optimizer.zero_grad(set_to_none=True); loss.backward()
  clip            job.backward(loss), then clip_grad_norm_ by hand
  plain-clip      loss.backward(), then clip_grad_norm_ by hand and a look at the norm
  no-sync         two micro-batches by hand: the first under `with job.no_sync()`
  aux             an auxiliary loss's backward under job.no_sync(), then the loss's
  reassign        the model reassigns a buffer in forward (self.ema = 0.9 * self.ema + ...)
  plateau         ReduceLROnPlateau, stepped by the loop on the group's loss after each committed step
  epoch-scheduler a StepLR the job steps after each step that ends an epoch (scheduler_every="epoch")
State: state["committed"] counts committed steps, updated after job.step()
returns True; every checkpoint and every member must agree with
job.step_count (checked here, and by the tests in the checkpoints).
"""
import argparse
import os
import signal
import time

import atexit
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import limbo

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
import cpu_limit  # noqa: E402


def make_data(n, seed):
    w = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))  # the task: one for both splits
    x = torch.randn(n, 16, generator=torch.Generator().manual_seed(seed))
    return x, (x @ w).argmax(1)


class Rows(Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"features": self.x[i], "label": self.y[i], "index": i}


def gated(h, gate):
    # A Python helper with data-dependent control flow.
    if float(gate.mean()) > 0:
        return h * torch.sigmoid(gate)
    return h


class DictNet(nn.Module):
    """forward(batch: dict) with Python control flow: not scriptable."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.gate = nn.Linear(16, 32)
        self.blocks = nn.ModuleList([nn.Linear(32, 32) for _ in range(2)])
        self.norm = nn.BatchNorm1d(32)
        self.out = nn.Linear(32, 4)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.reassign = False  # --habit reassign: an average of the hidden features, reassigned in forward

    def forward(self, batch):
        x = batch["features"]
        h = gated(F.relu(self.inp(x)), self.gate(x))
        for i, block in enumerate(self.blocks):
            h = h + F.relu(block(h)) if i % 2 == 0 else F.relu(block(h))
        if self.reassign and self.training:
            self.ema = 0.9 * self.ema + 0.1 * h.detach().mean(0)
        return self.frozen(self.out(self.norm(h)))


class Plain(nn.Module):
    """No batch statistics: a step of 2 x 16 is a step of 32, up to float
    rounding. `width` and `depth` make its steps as long as a test needs."""

    def __init__(self, width=32, depth=1):
        super().__init__()
        self.hidden = nn.Linear(16, width)
        self.more = nn.ModuleList(nn.Linear(width, width) for _ in range(depth - 1))
        self.out = nn.Linear(width, 4)

    def forward(self, batch):
        h = F.relu(self.hidden(batch["features"]))
        for layer in self.more:
            h = F.relu(layer(h))
        return self.out(h)


def fingerprint(job, model, opt, limbo_state=None, sched=None):
    """Weights, buffers, the optimizer's state (a torch.optim one's, or
    Limbo's own as job.optimizer_state() gave it at the last step), the
    scheduler's position and rates, the user's state."""
    w = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()
    b = sum(float(t.double().sum()) for t in model.buffers())
    st = []
    for k, v in sorted((limbo_state or {}).items()):
        st.append(float(v.double().sum()) if torch.is_tensor(v) else float(v))
    if sched is not None:
        st += [float(sched.last_epoch)] + [float(g["lr"]) for g in opt.param_groups]
    for group in ([] if isinstance(opt, limbo.Optimizer) else opt.param_groups):
        for p in group["params"]:
            for k, v in sorted(opt.state.get(p, {}).items()):
                st.append(float(v.double().sum()) if torch.is_tensor(v) else float(v))
    return "%d %.17g %.17g %.17g %s %s" % (job.step_count, float(w.sum()), float((w * w).sum()), b,
                                           " ".join("%.17g" % v for v in st),
                                           " ".join("%s=%s" % kv for kv in sorted(job.state.items())))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--optimizer", choices=["sgd", "adamw", "limbo-adamw", "limbo-adamw-sharded", "limbo-adamw-full"], default="sgd")
    p.add_argument("--model", choices=["dict", "plain"], default="dict")
    p.add_argument("--width", type=int, default=32, help="the plain model's hidden width")
    p.add_argument("--depth", type=int, default=1, help="the plain model's hidden layers")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--loader-workers", type=int, default=2)
    p.add_argument("--checkpoint-every-steps", type=int, default=0)
    p.add_argument("--run-dir", default=None)
    p.add_argument("--sync", choices=["step", "diloco"], default="step")
    p.add_argument("--inner-steps", type=int, default=4)
    p.add_argument("--compression", default="none")
    p.add_argument("--fragments", type=int, default=1)
    p.add_argument("--habit", choices=["job-backward", "plain-backward", "set-to-none", "clip", "plain-clip",
                                       "no-sync", "aux", "reassign", "plateau", "epoch-scheduler"],
                   default="job-backward")
    p.add_argument("--fetch", action="store_true", help="a function of the ids in place of the DataLoader")
    p.add_argument("--bucket-mb", type=float, default=4.0)
    p.add_argument("--clip-max", type=float, default=0.5, help="the norm of --habit clip and plain-clip")
    p.add_argument("--unseeded-frozen", action="store_true",
                   help="the frozen layer drawn from this process's own seed (differs between members)")
    p.add_argument("--evaluate", type=int, default=0,
                   help="at each epoch's end, job.evaluate() over a validation set of this many samples; each "
                        "member writes its result to eval-PID.txt (DIE_WHERE=in_eval dies inside it)")
    p.add_argument("--shares", choices=["equal", "pace"], default="equal")
    p.add_argument("--cpu-limit", default="",
                   help="RANK:FRACTION[:PERIOD_US]: the member of that rank at the first step holds itself to "
                        "FRACTION of a core (cgroup v1 cpu controller; its name in cgroup.txt of the run directory)")
    p.add_argument("--read-ahead", type=int, default=0,
                   help="at the first batch, ask the job's sampler for this many batches ahead (a loader that "
                        "prefetches that far); exit 3 with the job's message if it refuses")
    p.add_argument("--job-read-ahead", type=int, default=None, help="limbo.Job(read_ahead=...)")
    p.add_argument("--unfreeze-at", type=int, default=0,
                   help="the plain model's first layer is frozen when the job is made and unfrozen at the batch "
                        "after this many committed steps (once: a joiner never runs it)")
    p.add_argument("--unfreeze-group", action="store_true",
                   help="the optimizer starts without the frozen layer, which joins it as a parameter group "
                        "added when it is unfrozen")
    p.add_argument("--refreeze-at", type=int, default=0,
                   help="the plain model's output layer is frozen at the batch after this many committed steps "
                        "(once); it must not move after that")
    p.add_argument("--always", action="store_true",
                   help="after job.step(), whatever it returned: state['tried'] += 1 and the scheduler's step "
                        "(scheduler_every='manual'); both must equal the committed steps at the next batch")
    args = p.parse_args()

    torch.manual_seed(7)
    x, y = make_data(args.samples, 3)
    train = Rows(x, y)
    model = DictNet() if args.model == "dict" else Plain(args.width, args.depth)
    if args.habit == "reassign":
        model.reassign = True
        model.register_buffer("ema", torch.zeros(32))
    if args.unseeded_frozen:
        with torch.no_grad():
            model.frozen.weight.copy_(torch.randn(4, 4, generator=torch.Generator().manual_seed(os.getpid())))
    if args.unfreeze_at:
        model.hidden.requires_grad_(False)
    trained = [p for p in model.parameters() if p.requires_grad or not args.unfreeze_group]
    if args.optimizer == "sgd":
        opt = torch.optim.SGD(trained, lr=0.05, momentum=0.9)
    else:
        ids = {id(p) for p in trained}
        opt = torch.optim.AdamW([{"params": [p for n, p in model.named_parameters() if "out" in n and id(p) in ids],
                                  "lr": 3e-3},
                                 {"params": [p for n, p in model.named_parameters() if "out" not in n and id(p) in ids]}],
                                lr=1e-3, weight_decay=0.01)
    warmup = lambda s: min(1.0, (s + 1) / 10)  # noqa: E731
    state = {"committed": 0}
    if args.unfreeze_at:
        hidden_at_start = float(model.hidden.weight.double().sum())
    if args.optimizer.startswith("limbo-"):  # Limbo's own AdamW, its state sharded or not
        opt = limbo.Optimizer("adamw", lr=3e-3, weight_decay=0.01, shard_state=args.optimizer.endswith("sharded"))
        schedule = dict(lr_schedule=warmup)
        if args.optimizer.endswith("full"):  # the weights and the gradient sharded too
            schedule["shard"] = "full"
    elif args.habit == "plateau":  # stepped by the loop on a metric every member has: the group's loss
        schedule = dict(scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=10, factor=0.8))
    elif args.habit == "epoch-scheduler":
        schedule = dict(scheduler=torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
                        scheduler_every="epoch")
    else:
        schedule = dict(scheduler=torch.optim.lr_scheduler.LambdaLR(opt, warmup))
        if args.always:
            schedule["scheduler_every"] = "manual"
            state["tried"] = 0
    die_where = os.environ.get("DIE_WHERE", "")
    if die_where.startswith("commit_") and os.environ.get("LIMBO_RUN_DIR"):
        os.environ["LIMBO_TESTING_DIE_IN_COMMIT"] = "%s:%s:%s:%s:%s" % (
            os.environ.get("DIE_AT_STEP", "0"), die_where[len("commit_"):], os.environ.get("DIE_RANK", "1"),
            os.environ.get("DIE_HOW", "kill"), os.path.join(os.environ["LIMBO_RUN_DIR"], "died"))
    job = limbo.Job(model, opt, dataset=train, batch_size=args.batch_size, epochs=args.epochs,
                    state=state, run_dir=args.run_dir, checkpoint_every_steps=args.checkpoint_every_steps,
                    log_every=10, sync=args.sync, inner_steps=args.inner_steps, compression=args.compression,
                    max_wait=0, fragments=args.fragments, mixing=0.5 if args.fragments > 1 else 0.0,
                    bucket_mb=args.bucket_mb, shares=args.shares,
                    **({} if args.job_read_ahead is None else {"read_ahead": args.job_read_ahead}), **schedule)
    diloco = args.sync == "diloco"
    logged = [0]

    def log_outer():
        # DiLoCo: a line for each outer step committed since (the samples it committed).
        if log and diloco and job.step_count != logged[0]:
            epoch, ids = job.committed_ids()
            log.write("%d %d %s\n" % (job.step_count, epoch, " ".join(map(str, ids))))
            log.flush()
            logged[0] = job.step_count
    run_dir_ = job.run_dir or os.environ.get("LIMBO_RUN_DIR", "")

    def worker_started(_):
        # Each loader worker process that starts, under its member's pid: a
        # member's loader keeps its workers across re-formations.
        if run_dir_:
            with open(os.path.join(run_dir_, "loader-%d.txt" % os.getppid()), "a") as f:
                f.write("%d\n" % os.getpid())
    loader = DataLoader(train, batch_sampler=job.sampler, num_workers=args.loader_workers,
                        worker_init_fn=worker_started)
    per_epoch = len(loader)  # as a schedule over epochs * len(loader) would take it: the same on every member
    if args.fetch:
        loader = lambda ids: {"features": x[ids], "label": y[ids], "index": torch.tensor(ids)}  # noqa: E731
    run_dir = job.run_dir or os.environ.get("LIMBO_RUN_DIR", "")
    pace = float(os.environ.get("PACE", "0"))
    pace_until = int(os.environ.get("PACE_UNTIL", "0"))
    die_at = int(os.environ.get("DIE_AT_STEP", "0"))
    die_rank = int(os.environ.get("DIE_RANK", "1"))
    how = signal.SIGSTOP if os.environ.get("DIE_HOW", "kill") == "stop" else signal.SIGKILL
    where = os.environ.get("DIE_WHERE", "before_step")

    def maybe_die(point):
        # Once a job: the first member to get there claims the marker file.
        if not (die_at > 0 and point == where and job.step_count == die_at and job.rank == die_rank
                and job.world > 1):
            return
        try:
            fd = os.open(os.path.join(run_dir, "died"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.write(fd, b"%d %s\n" % (os.getpid(), point.encode()))
        os.close(fd)
        os.kill(os.getpid(), how)

    def maybe_limit():
        # Once a job: the member of the given rank at its first batch.
        if not args.cpu_limit or job.world < 2:
            return
        parts = args.cpu_limit.split(":")
        if job.rank != int(parts[0]):
            return
        try:
            fd = os.open(os.path.join(run_dir, "cgroup.txt"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        name = "limbo-test-%d" % os.getpid()
        os.write(fd, name.encode() + b"\n")
        os.close(fd)
        cpu_limit.limit(name, float(parts[1]), int(parts[2]) if len(parts) > 2 else 100000)
        cpu_limit.add(name, os.getpid())
        atexit.register(cpu_limit.remove, name)

    log = open(os.path.join(run_dir, "samples-%d.txt" % os.getpid()), "a") if run_dir else None
    limbo_state = None
    for batch in job.batches(loader):
        log_outer()
        maybe_limit()
        if args.read_ahead:
            try:
                ahead = iter(job.sampler)
                for _ in range(args.read_ahead):
                    next(ahead)
            except limbo.InvalidInput as e:
                print("refused: %s" % e, file=sys.stderr, flush=True)
                os._exit(3)
            print("read %d batches ahead" % args.read_ahead, file=sys.stderr, flush=True)
            os._exit(0)
        if args.unfreeze_at and job.step_count == args.unfreeze_at:  # the fine-tuning schedule
            model.hidden.requires_grad_(True)
            if args.unfreeze_group and not any(q is model.hidden.weight for g in opt.param_groups for q in g["params"]):
                opt.add_param_group({"params": list(model.hidden.parameters()), "lr": 0.02})
        if args.refreeze_at and job.step_count == args.refreeze_at:
            model.out.requires_grad_(False)
            state["out_at_freeze"] = float(model.out.weight.double().sum())
        if "out_at_freeze" in state and float(model.out.weight.double().sum()) != state["out_at_freeze"]:
            raise SystemExit("the output layer moved after it was frozen, at step %d" % job.step_count)
        maybe_die("before_forward")
        if pace and (pace_until == 0 or job.world < pace_until):
            time.sleep(pace)
        # The loader's batch is the one the job dealt to this member.
        assert batch["index"].tolist() == job.batch_ids(), (batch["index"].tolist(), job.batch_ids())
        if not diloco and state["committed"] != job.step_count:
            raise SystemExit("state['committed'] is %d at step %d" % (state["committed"], job.step_count))
        if args.always and (state["tried"] != job.step_count or schedule["scheduler"].last_epoch != job.step_count):
            raise SystemExit("after a step that did not commit: state['tried'] %d, the scheduler at %d, step %d"
                             % (state["tried"], schedule["scheduler"].last_epoch, job.step_count))
        habit = args.habit
        if habit in ("plain-backward", "plain-clip"):
            opt.zero_grad()
        elif habit == "set-to-none":
            opt.zero_grad(set_to_none=True)
        if habit == "no-sync":
            half = len(batch["label"]) // 2
            parts = [{k: v[:half] for k, v in batch.items()}, {k: v[half:] for k, v in batch.items()}]
            opt.zero_grad()
            with job.no_sync():
                (F.cross_entropy(model(parts[0]), parts[0]["label"]) * half / len(batch["label"])).backward()
            maybe_die("before_backward")
            loss = F.cross_entropy(model(parts[1]), parts[1]["label"]) * (len(batch["label"]) - half) / len(batch["label"])
            loss.backward()
        else:
            out = model(batch)
            loss = F.cross_entropy(out, batch["label"])
            maybe_die("before_backward")
            if habit == "aux":
                opt.zero_grad()
                with job.no_sync():
                    (0.1 * out.pow(2).mean()).backward(retain_graph=True)
                loss.backward()
            elif habit in ("job-backward", "clip", "reassign", "plateau", "epoch-scheduler"):
                job.backward(loss)
            else:
                loss.backward()
        if habit in ("clip", "plain-clip"):
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_max)
            job.log(grad_norm_by_hand=float(norm))
        maybe_die("before_step")
        ids, epoch = job.global_ids(), int(job.epoch)
        ok = job.step()
        if args.always:  # the habit of a loop that does not look at what job.step() returned
            state["tried"] += 1
            schedule["scheduler"].step()
        if ok and isinstance(opt, limbo.Optimizer) and not diloco and job.epoch >= args.epochs:
            limbo_state = job.optimizer_state()  # a collective: every member at the last step
        if ok and args.evaluate and job.epoch_ended:
            vx, vy = make_data(args.evaluate, 5)

            def measure(b):
                maybe_die("in_eval")
                out = model(b)
                return {"count": len(b["label"]), "correct": int((out.argmax(1) == b["label"]).sum()),
                        "loss": float(F.cross_entropy(out, b["label"], reduction="sum")),
                        "idsum": int(b["index"].sum())}
            got = job.evaluate(measure, Rows(vx, vy), batch_size=32, num_workers=args.loader_workers)
            with open(os.path.join(run_dir, "eval-%d.txt" % os.getpid()), "a") as f:
                f.write("%d %d %d %.17g %d\n" % (job.step_count, got["count"], got["correct"], got["loss"],
                                                 got["idsum"]))
        if ok and habit == "plateau":
            schedule["scheduler"].step(job.loss)
        if ok and not diloco:  # DiLoCo: job.step() is an inner step; outer steps commit in job.batches()
            state["committed"] += 1
            job.log(my_metric=float(loss), lr0=opt.lr if isinstance(opt, limbo.Optimizer) else opt.param_groups[0]["lr"])
            if log and not diloco:
                log.write("%d %d %s\n" % (job.step_count, epoch, " ".join(map(str, ids))))
                log.flush()
        maybe_die("after_step")
    log_outer()
    if log:
        log.close()
    with torch.no_grad():
        model.eval()
        tx, ty = make_data(512, 4)
        acc = float((model({"features": tx}).argmax(1) == ty).float().mean())
    if args.unfreeze_at:
        job.state["hidden_moved"] = int(float(model.hidden.weight.double().sum()) != hidden_at_start)
    summary = job.finish(test_accuracy=acc)
    if run_dir and job.step_count > 0 and not job.left:
        with open(os.path.join(run_dir, "final-%d.txt" % os.getpid()), "w") as f:
            f.write(fingerprint(job, model, opt, limbo_state, schedule.get("scheduler")) + " len=%d\n" % per_epoch)
    if summary is not None and job.is_writer:
        print("done: %d steps, accuracy %.3f" % (summary["steps"], acc), flush=True)


if __name__ == "__main__":
    main()
