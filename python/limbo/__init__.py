"""Limbo from Python: elastic data-parallel training in your own PyTorch loop.

    import limbo
    job = limbo.Job(model, optimizer, dataset=train_set, batch_size=64, epochs=3)
    loader = DataLoader(train_set, batch_sampler=job.sampler, num_workers=2)
    for x, y in job.batches(loader):
        loss = F.cross_entropy(model(x), y)
        job.backward(loss)
        job.step()
    job.finish(test_accuracy=evaluate(model))

Run it alone (`python3 train.py`: one member, no launcher) or as the workers
of a job (`limbo launch --nproc 2 --min-workers 1 -- python3 train.py`): the
same code joins the job from the launcher's environment. docs/python.md
describes every argument, the guarantees and the error policy.
"""

import atexit
import contextlib
import copy
import io
import json
import os
import signal
import sys
import weakref

import torch

from . import _core
from ._core import InvalidInput, LimboError

__all__ = ["Job", "Optimizer", "InvalidInput", "LimboError", "UsageError", "load_checkpoint"]


class UsageError(InvalidInput):
    """The job was used out of order (a step outside the loop, a batch without a step)."""


def _env_flag(name):
    return os.environ.get(name, "") not in ("", "0", "false")


def _adam_like(optimizer):
    if isinstance(optimizer, Optimizer):
        return optimizer.algorithm in ("adam", "adamw")
    return any("Adam" in c.__name__ for c in type(optimizer).__mro__)


class Optimizer:
    """One of Limbo's optimizers, in place of a torch.optim one: its state
    lives in Limbo (float32, over the flat parameters), moves natively in
    state sync and checkpoints, and with shard_state=True is sharded across
    the members (ZeRO-1) with a copy of each shard on the next host
    (docs/sharded_state.md). The same algorithms as the CLI's optim.*:

        limbo.Optimizer("sgd", lr=0.05, momentum=0.9, nesterov=False, weight_decay=0.0)
        limbo.Optimizer("adamw", lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                        shard_state=True)

    The rate of a step is lr x Job(lr_schedule=f)'s f(step) x the batch
    policy's multiplier."""

    def __init__(self, algorithm="sgd", *, lr, momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0,
                 betas=(0.9, 0.999), eps=1e-8, shard_state=False):
        if algorithm not in ("sgd", "adam", "adamw"):
            raise InvalidInput("limbo.Optimizer: unknown algorithm %r; allowed: sgd, adam, adamw" % (algorithm,))
        self.algorithm, self.lr = algorithm, float(lr)
        self.options = dict(algorithm=algorithm, momentum=float(momentum), dampening=float(dampening),
                            nesterov=bool(nesterov), weight_decay=float(weight_decay), beta1=float(betas[0]),
                            beta2=float(betas[1]), eps=float(eps), shard_state=bool(shard_state))
        self._params = None  # the model's parameters, once a limbo.Job took this optimizer
        self._full = False

    def zero_grad(self, set_to_none=True):
        """What torch.optim's zero_grad() does, for the loops that call it: the
        gradient of every parameter of the job's model is gone (None), or
        zeros with set_to_none=False. The job starts every step's gradient
        from nothing itself, so the call is never needed. With
        shard="full" it is always None: zeros would bring back the pages of
        the whole gradient that the members give back."""
        if self._params is None:
            raise UsageError("limbo.Optimizer.zero_grad(): the optimizer is not a limbo.Job's yet "
                             "(limbo.Job(model, optimizer, ...) takes the model's parameters)")
        for p in self._params():
            if set_to_none or p.grad is None or self._full:
                p.grad = None
            else:
                p.grad.detach_()
                p.grad.zero_()


def _unit_names(model, units):
    """The submodules that are units of shard="full": `units` names them, or
    says for each (name, module) whether it is one; by default every child
    of a ModuleList or Sequential that holds parameters (a transformer's
    blocks), the outermost ones only."""
    named = dict(model.named_modules())
    if units is None:
        out = []
        for name, m in named.items():
            if not isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)):
                continue
            if any(name == u or name.startswith(u + ".") for u in out):
                continue  # inside a unit already
            for child, c in m.named_children():
                if any(p.requires_grad for p in c.parameters()):
                    out.append(name + "." + child if name else child)
        return out
    if callable(units):
        out = []
        for name, m in named.items():
            if name and not any(name.startswith(u + ".") for u in out) and units(name, m):
                out.append(name)
        return out
    if isinstance(units, str) or not all(isinstance(u, str) for u in units):
        raise InvalidInput("units must be a list of submodule names, or a function of (name, module)")
    for u in units:
        if u not in named or not u:
            raise InvalidInput("units: the model has no submodule %r" % (u,))
    return list(units)


def _tensors_in(output):
    """The tensors in a module's output (a tensor, or tuples, lists and dicts of them)."""
    if torch.is_tensor(output):
        yield output
    elif isinstance(output, (tuple, list)):
        for x in output:
            yield from _tensors_in(x)
    elif isinstance(output, dict):
        for x in output.values():
            yield from _tensors_in(x)


class _Sampler:
    """The DataLoader's batch_sampler: this member's sample ids for each step,
    from the job's committed position (every sample exactly once an epoch
    across the whole group, whatever joins or leaves)."""

    def __init__(self, job):
        self._job = job

    def __iter__(self):
        core = self._job._core
        epoch, position = core.cursor
        first, ahead = core.steps, 0
        while True:
            planned = core.plan(epoch, position, first, ahead)
            if planned is None:
                return
            ids, epoch, position = planned
            ahead += 1
            yield ids

    def __len__(self):
        """Batches in an epoch at the group's size when the run began (the
        same on every member, joiners and resumed runs included: a schedule
        written over `epochs * len(loader)` is the same function everywhere).
        The steps an epoch really takes follow the group's size."""
        job = self._job
        core = job._core
        if core.diloco:  # an outer step's share: inner_steps batches at most
            return job._inner_steps
        world = job._first_world or core.world
        global_batch = job.batch_size * world
        rest = job.dataset_size % global_batch
        if job.drop_last or (job.dataset_size >= global_batch and 0 < rest < world):
            return max(1, job.dataset_size // global_batch)
        return -(-job.dataset_size // global_batch)


class Job:
    """One member of an elastic data-parallel job, around the user's model,
    optimizer and data.

    model       any torch.nn.Module (float32 parameters on the CPU); its
                parameters and buffers become views of Limbo's flat buffers.
                Build it completely first; frozen parameters (requires_grad
                False) are left alone while frozen, buffers are kept in step
                as the CLI does.
    frozen      "may_train" (default): the loop may unfreeze or freeze layers
                and add parameter groups at any step (frozen float32
                parameters sit in Limbo's buffers, off the wire while every
                member has them frozen; an unfrozen layer trains from the
                step after); "fixed": frozen parameters stay out and such
                changes are refused.
    optimizer   any torch.optim optimizer over the model's parameters: Limbo
                calls its step() with the reduced gradient; its state_dict is
                handed to joiners, taken from the newest member after a failed
                step, and saved in checkpoints.
    scheduler   an lr_scheduler, stepped after every committed step (its state
                travels with the optimizer's), or None.
    dataset     the training set (map-style: len() and indices) or its size.
    batch_size  samples per member per step; the global batch is
                batch_size x workers.
    epochs, max_steps, seed, order ("shuffle" | "sequential" | "fixed_cycle"),
    drop_last   what is trained, in which order (a function of the seed).
    state       a dict of the user's own state, saved and restored with the
                job's (updated in place).
    run_dir     where metrics.jsonl, checkpoints and summary.json go
                (default: the launcher's --run-dir; alone: none).
    resume      continue from run_dir's checkpoint (default: the launcher's
                --resume).
    clip_grad_norm   clip the reduced gradient to this global norm (0: off).
    accumulate  backwards a step (micro-batches of the step's batch, each loss
                divided by accumulate as its gradient is); the gradient is
                reduced once, during the last.
    scale_lr    multiply the optimizer's learning rates, for each step, by the
                batch policy's multiplier (Dynamic SGD for SGD, the
                square-root rule for Adam-like optimizers); job.lr_multiplier
                is the value either way.
    batch_policy, lr_scaling, reference_batch, ramp_steps
                the batch policy (docs/config.md: elastic.batch_policy ...).
    checkpoint_every_epochs, checkpoint_every_steps, log_every
                as in the CLI (a final checkpoint is always written).
    overlap, bucket_mb, compression, shared_memory, hierarchical,
    collective_timeout, round_timeout
                communication, as the CLI's keys of the same names
                (compression also takes "int8" and "int4" for DiLoCo).
    shares      "equal" (every member an equal slice of the global batch) or
                "pace" (slices by each member's pace, as elastic.shares:
                members of unequal speed do not wait for the slowest;
                job.batch_ids() is this member's slice, and train records
                carry "shares" and "paces"). With sync="diloco", each
                member's share of an outer step follows its pace in the
                previous one (outer records carry "shares" and "paces").
                "auto" (the default): "pace" with sync="diloco", "equal"
                with sync="step".
    read_ahead  with shares="pace" and sync="step": batches a loader may
                read ahead of the step it feeds (a DataLoader's num_workers
                x prefetch_factor; default 15, one more is refused, naming
                this). A batch's share is agreed read_ahead + 1 steps
                before it, so a smaller value follows a change of pace
                sooner. The same on every member.
    sync        "step" (every step's gradient reduced across the group) or
                "diloco" (docs/diloco.md): the optimizer becomes the inner
                one, stepped by job.step() on this member alone, for the
                inner_steps batches of its share; then, inside job.batches(),
                the outer step averages the members' pseudo-gradients and
                Limbo's outer SGD (outer_lr, outer_momentum, nesterov) moves
                the global weights. A step then counts outer steps (max_steps,
                checkpoint_every_steps); max_wait bounds the wait for a slow
                member as diloco.max_wait does. The inner optimizer's state
                travels with the user's state (a re-formed group takes the
                state member's). fragments and mixing make it streaming
                DiLoCo, as diloco.fragments and diloco.mixing do (a step
                then syncs one fragment every inner_steps / fragments
                batches; the sync is not overlapped with the user's loop).
    """

    def __init__(self, model, optimizer, *, dataset, batch_size, epochs=1, max_steps=0,
                 scheduler=None, lr_schedule=None, seed=1, order="shuffle", drop_last=False, state=None,
                 run_dir=None, resume=None, clip_grad_norm=0.0, scale_lr=True,
                 batch_policy="dynamic", lr_scaling="auto", reference_batch=0, ramp_steps=200,
                 accumulate=1, checkpoint_every_epochs=1, checkpoint_every_steps=0, log_every=50,
                 overlap=True, bucket_mb=4.0, compression="none", shared_memory=True,
                 hierarchical=True, collective_timeout=10.0, round_timeout=120.0, shares="auto", read_ahead=15,
                 max_nonfinite_steps=10, sync="step", inner_steps=500, outer_lr=0.7, outer_momentum=0.9,
                 nesterov=True, max_wait=1.0, fragments=1, mixing=0.0, scheduler_every=None,
                 frozen="may_train", shard="none", units=None):
        if not isinstance(model, torch.nn.Module):
            raise InvalidInput("model must be a torch.nn.Module, got %s" % type(model).__name__)
        own = isinstance(optimizer, Optimizer)
        if not own and not isinstance(optimizer, torch.optim.Optimizer):
            raise InvalidInput("optimizer must be a torch.optim.Optimizer or a limbo.Optimizer, got %s"
                               % type(optimizer).__name__)
        if own and scheduler is not None:
            raise InvalidInput("a torch lr_scheduler steps a torch.optim optimizer; with limbo.Optimizer give "
                               "lr_schedule=f (the rate is lr x f(step))")
        if not own and lr_schedule is not None:
            raise InvalidInput("lr_schedule is for limbo.Optimizer; a torch.optim optimizer takes scheduler=")
        schedulers = [] if scheduler is None else list(scheduler) if isinstance(scheduler, (list, tuple)) \
            else [scheduler]
        for sc in schedulers:
            if not hasattr(sc, "state_dict") or not hasattr(sc, "step"):
                raise InvalidInput("scheduler must be a torch.optim.lr_scheduler (or a list of them), got %s"
                                   % type(sc).__name__)
        plateau = any(isinstance(sc, torch.optim.lr_scheduler.ReduceLROnPlateau) for sc in schedulers)
        if scheduler_every is None:
            scheduler_every = "manual" if plateau else "step"
        if scheduler_every not in ("step", "epoch", "manual"):
            raise InvalidInput("scheduler_every must be \"step\", \"epoch\" or \"manual\", got %r"
                               % (scheduler_every,))
        if plateau and scheduler_every != "manual":
            raise InvalidInput("a ReduceLROnPlateau steps on a metric: scheduler_every=\"manual\" and call "
                               "scheduler.step(metric) yourself after a committed step (its state travels)")
        if not own and not schedulers and getattr(optimizer.step, "_with_counter", False):
            # A scheduler made over this optimizer that the job was not given:
            # its position would not travel to joiners, checkpoints or a redo.
            raise InvalidInput("the optimizer has an lr_scheduler that limbo.Job was not given: pass it as "
                               "scheduler= (a list for several; scheduler_every=\"manual\" if you step it "
                               "yourself), so that its state travels with the optimizer's")
        owned = {id(p) for p in model.parameters()}
        for g in ([] if own else optimizer.param_groups):
            for p in g["params"]:
                if id(p) not in owned:
                    raise InvalidInput("the optimizer holds a parameter that is not the model's")
        devices = {str(p.device) for p in model.parameters()} | {str(b.device) for b in model.buffers()}
        if len(devices) > 1:
            raise InvalidInput("the model's tensors are on several devices (%s); Limbo trains on the CPU: "
                               "model.to('cpu') first" % ", ".join(sorted(devices)))
        try:
            size = len(dataset)
        except TypeError:
            size = dataset
        if not isinstance(size, int) or isinstance(size, bool):
            raise InvalidInput("dataset must be a map-style data set (with len()) or its size, got %r"
                               % type(dataset).__name__)
        if shard not in ("none", "state", "full"):
            raise InvalidInput("shard must be \"none\", \"state\" (the optimizer state) or \"full\" (the weights, "
                               "the gradient and the optimizer state), got %r" % (shard,))
        if shard != "none" and not own:
            raise InvalidInput("shard=%r steps each member's shard with Limbo's optimizer: pass limbo.Optimizer(...) "
                               "(a torch.optim optimizer steps whole parameters)" % (shard,))
        if shard != "none" and sync != "step":
            raise InvalidInput("shard=%r runs with sync=\"step\" (DiLoCo's inner optimizer is each member's own)"
                               % (shard,))
        if units is not None and shard != "full":
            raise InvalidInput("units= cuts the model for shard=\"full\"")
        unit_names = _unit_names(model, units) if shard == "full" else []
        if frozen not in ("may_train", "fixed"):
            raise InvalidInput("frozen must be \"may_train\" or \"fixed\", got %r" % (frozen,))
        if state is not None and not isinstance(state, dict):
            raise InvalidInput("state must be a dict, got %s" % type(state).__name__)
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self._schedulers, self._scheduler_every = schedulers, scheduler_every
        self._own = own
        self._lr_schedule = lr_schedule
        self.state = state if state is not None else {}
        self.dataset_size, self.batch_size = size, int(batch_size)
        self.epochs, self.max_steps, self.drop_last = int(epochs), int(max_steps), bool(drop_last)
        self.scale_lr = bool(scale_lr)
        self._checkpoint_epochs = int(checkpoint_every_epochs)
        self._checkpoint_steps = int(checkpoint_every_steps)
        self._log_every = int(log_every)
        env = os.environ
        if run_dir is None:
            run_dir = env.get("LIMBO_RUN_DIR", "")
        if resume is None:
            resume = _env_flag("LIMBO_RESUME")
        if env.get("LIMBO_THREADS"):
            torch.set_num_threads(int(env["LIMBO_THREADS"]))
        self._progress = env.get("LIMBO_PROGRESS", "1") != "0"
        if lr_scaling == "auto":
            lr_scaling = "sqrt" if _adam_like(optimizer) else "linear"
        options = dict(
            batch_size=self.batch_size, dataset_size=size, epochs=self.epochs, max_steps=self.max_steps,
            seed=int(seed), order=order, drop_last=self.drop_last, run_dir=run_dir or "", resume=bool(resume),
            clip_grad_norm=float(clip_grad_norm), batch_policy=batch_policy, lr_scaling=lr_scaling,
            reference_batch=int(reference_batch), ramp_steps=int(ramp_steps), log_every=self._log_every,
            checkpoint_every_epochs=self._checkpoint_epochs, checkpoint_every_steps=self._checkpoint_steps,
            overlap=bool(overlap), bucket_mb=float(bucket_mb), compression=compression, shares=shares,
            read_ahead=int(read_ahead),
            shared_memory=bool(shared_memory), hierarchical=bool(hierarchical),
            collective_timeout=float(collective_timeout), round_timeout=float(round_timeout),
            max_nonfinite_steps=int(max_nonfinite_steps), accumulate=int(accumulate),
            rdzv=env.get("LIMBO_RDZV", ""), elastic=_env_flag("LIMBO_ELASTIC"),
            rank=int(env.get("LIMBO_RANK", "0")), world=int(env.get("LIMBO_WORLD", "1")),
            token=env.get("LIMBO_JOB_TOKEN", ""), sync=sync, inner_steps=int(inner_steps),
            outer_lr=float(outer_lr), outer_momentum=float(outer_momentum), nesterov=bool(nesterov),
            max_wait=float(max_wait), fragments=int(fragments), mixing=float(mixing))
        # Signals whose handler is the user's own (not Python's defaults):
        # the job's handler, which leaves at the next agreed step, runs it too.
        options["chain_signals"] = [
            int(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
            if callable(signal.getsignal(sig)) and signal.getsignal(sig) is not signal.default_int_handler]
        # An outer step's share (streaming: a unit's, inner_steps / fragments).
        self._inner_steps = int(inner_steps) // max(int(fragments), 1)
        if own:
            options["limbo_optimizer"] = dict(optimizer.options)
            if shard != "none":
                options["limbo_optimizer"]["shard_state"] = True
        options["shard_weights"] = shard == "full"
        options["units"] = unit_names
        # Frozen float32 parameters in Limbo's flat buffers (off the wire
        # while frozen on every member), so that the loop may unfreeze them
        # (and freeze others) later; with Limbo's optimizer, whose state
        # spans the flat buffer, or DiLoCo's outer step, they stay out.
        self._may_train = frozen == "may_train" and not own and sync == "step"
        self._sync = sync
        options["frozen_in_flat"] = self._may_train
        options["config_toml"] = self._describe(options)
        params = list(model.named_parameters())
        buffers = [(n, b) for n, b in model.named_buffers() if b is not None]
        # What the job took of the model, checked after every batch (a few
        # dict lookups): a parameter unfrozen, frozen or replaced, a buffer
        # reassigned, a parameter group added would leave Limbo's view of the
        # model behind the user's, members diverging silently.
        self._param_refs = [(m, n, p, p.requires_grad) for m in model.modules()
                            for n, p in m._parameters.items() if p is not None]
        if own:  # its zero_grad(), as a loop written for torch.optim calls it
            me_ref = weakref.ref(self)
            optimizer._params = lambda: [r[2] for r in me_ref()._param_refs] if me_ref() is not None else []
            optimizer._full = shard == "full"
        self._buffer_refs = [(m, n, b) for m in model.modules() for n, b in m._buffers.items() if b is not None]
        self._groups = None if own else len(optimizer.param_groups)
        self._names = {id(p): n for n, p in params}
        # The parameters in Limbo's flat buffers: whether each is trainable
        # travels with the state (a joiner's loop may never run the line
        # that unfroze a layer).
        self._in_flat = [(n, p) for n, p in params
                         if p.requires_grad or (self._may_train and p.dtype == torch.float32)]
        # Frozen float parameters outside them travel with the state too (the
        # values of the member everyone takes), as DDP broadcasts them when
        # it starts.
        flat_ids = {id(p) for _, p in self._in_flat}
        self._frozen = [(n, p) for n, p in params if id(p) not in flat_ids and p.is_floating_point()]
        # The core calls back through a weak reference: a Job the program
        # drops is freed with its core (its threads, sockets and handlers),
        # not kept alive by a cycle through C++ that Python cannot collect.
        me = weakref.ref(self)
        # A buffer reassigned in forward goes back in place before backward
        # (and so before the reduction averages the buffers).
        self._forward_hook = None
        if self._buffer_refs:
            def after_forward(module, inputs, output):
                job = me()
                if job is not None:
                    job._reseat_buffers()
            self._forward_hook = model.register_forward_hook(after_forward)
            weakref.finalize(self, self._forward_hook.remove)  # a dropped job leaves no hook behind
        self._core = _core.Core(params, buffers, options, lambda: me()._pack(), lambda b: me()._unpack(b),
                                lambda m: me()._optimizer_step(m))
        self.sampler = _Sampler(self)
        if shard == "full":
            self._unit_hooks(me)
        self._loss = None
        self._stepped = True
        self._committed = False   # the step of the batch in the loop committed: its work follows the user's code
        self._rollback = None     # after a step that did not commit: the committed user state, put back
        self._scheduler_marks = None
        self._epoch_ended = False
        self._ended = False
        self._summary = None
        self._finished = False
        self._first_world = None  # the group's size when the run began: from the state when joining
        self._started = self._core.start()
        if self._first_world is None:
            self._first_world = self._core.world


    # -- what the loop sees ------------------------------------------------
    @property
    def world(self):
        """Members in the group now."""
        return self._core.world

    @property
    def rank(self):
        """This member's rank in the group now."""
        return self._core.rank

    @property
    def step_count(self):
        """Committed steps (every member agrees)."""
        return self._core.steps

    @property
    def epoch(self):
        """Fractional epochs trained (committed)."""
        return self._core.epoch

    @property
    def samples(self):
        return self._core.samples

    @property
    def global_batch(self):
        """Samples in this step's global batch (all members)."""
        return self._core.global_batch

    @property
    def lr_multiplier(self):
        """The batch policy's multiplier for this step's learning rate."""
        return self._core.lr_multiplier

    @property
    def is_writer(self):
        """This member writes the run directory."""
        return self._core.writer

    @property
    def run_dir(self):
        return self._core.run_dir

    @property
    def left(self):
        """This member left the job (asked to stop, or training completed elsewhere)."""
        return self._core.left

    @property
    def epoch_ended(self):
        """The last committed step ended an epoch (a place to evaluate)."""
        return self._epoch_ended

    def global_ids(self):
        """The sample ids of this step's global batch (every member's), in order."""
        return self._core.global_ids()

    def committed_ids(self):
        """sync="diloco": (epoch, ids) of the last committed outer step, the
        samples every member processed in it, in the order they were dealt."""
        return self._core.committed_ids()

    def batch_ids(self):
        """This member's sample ids of this step (the indices its batch was read from)."""
        return self._core.batch_ids()

    def batches(self, loader):
        """Yields the loader's batches, one step each, until training is
        complete. `loader` is a DataLoader over job.sampler, or a function
        that makes this member's batch from a list of sample ids (in memory:
        `lambda ids: (x[ids], y[ids])`, without the DataLoader's cost per
        sample). After a failed step or a membership change the loader is
        started again from the committed position with the new group, so the
        failed step's samples are dealt again."""
        fetch = loader if callable(loader) and not hasattr(loader, "batch_sampler") else None
        if fetch is None and getattr(loader, "batch_sampler", None) is not self.sampler:
            raise UsageError("the DataLoader must take its batches from the job: "
                             "DataLoader(dataset, batch_sampler=job.sampler, ...), or give job.batches() "
                             "a function of the sample ids")
        self._epoch_ended = False
        if not self._started:
            return
        core = self._core
        if fetch is None:
            loader = self._keeping_workers(loader)
        while not core.complete():
            generation = core.generation
            core.clear_plans()
            iterator = iter(loader) if fetch is None else (fetch(ids) for ids in self.sampler)
            for batch in iterator:
                core.begin_step()
                self._stepped = False
                yield batch
                if not self._stepped:
                    raise UsageError("job.step() was not called for a batch of job.batches(): "
                                     "call job.backward(loss) and job.step() once a batch")
                # The user's code after job.step() has run: the step's work
                # (records, checkpoints, a membership change, state handed to
                # a joiner) sees the state it left; after a step that did not
                # commit, what it changed is put back.
                self._end_of_batch()
                if core.left or core.generation != generation:
                    break
            del iterator
            if core.left:
                return
            # DiLoCo: the share's inner steps are done (or there were none:
            # an outer step being redone); the outer step follows.
            if core.diloco and core.generation == generation and core.outer_finish():
                self._after_commit()
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None
        self._ended = core.end_training()
        if self._ended:
            _unfinished.add(self)  # finish() at exit if the program does not call it

    def full_state_dict(self):
        """The model's state_dict with every parameter whole, as copies. With
        shard="full" the weights are gathered from the members' shards first:
        a collective, so every member calls it at the same point between
        steps (a member lost meanwhile: the group re-forms and the gather is
        done again); they are given back at the next step. Otherwise it is
        model.state_dict()'s copy."""
        self._core.gather_weights()
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def _unit_hooks(self, me):
        """shard="full": each unit's weights gathered from the members' shards
        just before its forward and again before its backward (a hook on its
        outputs' gradient), and given back after its forward; the gradient's
        buckets give them back again in backward (docs/sharded_state.md).
        Unit 0, the parameters of no other unit, is gathered before the
        model's forward and kept until backward has their gradients."""
        def gather(u, forward):
            job = me()
            if job is not None:
                job._core.gather_unit(u, forward)

        def root_pre(module, inputs):
            gather(0, True)
        handles = [self.model.register_forward_pre_hook(root_pre)]
        for u, (name, _) in enumerate(self._core.units()):
            if u == 0:
                continue

            def pre(module, inputs, u=u):
                gather(u, True)

            def post(module, inputs, output, u=u):
                job = me()
                if job is None:
                    return
                job._core.release_unit(u)
                if torch.is_grad_enabled():
                    for t in _tensors_in(output):
                        if t.requires_grad:
                            t.register_hook(lambda grad, u=u: gather(u, False))
            mod = self.model.get_submodule(name)
            handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
        for h in handles:
            weakref.finalize(self, h.remove)

    @staticmethod
    def _keeping_workers(loader):
        """The DataLoader, with worker processes that outlive a re-formation:
        after a failed step or a membership change the loader starts again
        from the committed position, and a loader whose workers are not
        persistent would fork them all again before the next step (0.1 s and
        more a worker, with torch loaded). The same loader with
        persistent_workers=True keeps them and hands them the new plan; the
        batches they had fetched ahead for the old one are dropped."""
        if loader.num_workers == 0 or loader.persistent_workers:
            return loader
        return torch.utils.data.DataLoader(
            loader.dataset, batch_sampler=loader.batch_sampler, num_workers=loader.num_workers,
            collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, timeout=loader.timeout,
            worker_init_fn=loader.worker_init_fn, multiprocessing_context=loader.multiprocessing_context,
            generator=loader.generator, prefetch_factor=loader.prefetch_factor, persistent_workers=True,
            pin_memory_device=loader.pin_memory_device)

    def _check_model(self):
        for m, n, p, trainable in self._param_refs:
            now = m._parameters.get(n)
            if now is not p:
                raise UsageError("parameter %r of %s was replaced after limbo.Job took the model; change its "
                                 "values in place (with torch.no_grad(): p.copy_(...))" % (n, type(m).__name__))
            if trainable and p.dtype != torch.float32:
                raise InvalidInput("parameter %r of %s became %s after limbo.Job took the model (model.half() or "
                                   ".to(dtype)?); Limbo trains float32 parameters: keep the model in float32 and "
                                   "compute in bf16 under torch.autocast" % (n, type(m).__name__, p.dtype))
            if p.requires_grad != trainable and not (self._may_train and p.dtype == torch.float32):
                why = ("it is not float32" if p.dtype != torch.float32
                       else "the job was made with limbo.Optimizer" if self._own
                       else "the job runs sync=\"diloco\"" if self._sync != "step"
                       else "the job was made with frozen=\"fixed\"")
                raise UsageError(
                    "parameter %r of %s was %s after limbo.Job took the model, and %s: then the job reduces, "
                    "steps and hands to joiners only the parameters that were trainable when it was made. Keep "
                    "it trainable from the start (a torch.optim parameter group at lr=0 until it should train), "
                    "or use a torch.optim optimizer with sync=\"step\" and frozen=\"may_train\" (the "
                    "default), under which a layer may be unfrozen or frozen at any step"
                    % (n, type(m).__name__, "unfrozen" if p.requires_grad else "frozen", why))
        self._reseat_buffers()
        if self._groups is not None and len(self.optimizer.param_groups) != self._groups:
            # A group added later (the layer just unfrozen, at a rate of its
            # own): its parameters must be the model's, in Limbo's buffers;
            # the groups travel with the state by parameter name.
            for g in self.optimizer.param_groups[self._groups:]:
                for q in g["params"]:
                    if id(q) not in self._names:
                        raise UsageError("a parameter group added to the optimizer holds a tensor that is not a "
                                         "parameter of the model limbo.Job took; add the model's own parameters")
                    if not self._may_train and not any(q is p for _, p in self._in_flat):
                        raise UsageError("a parameter group added to the optimizer holds %r, which was frozen "
                                         "when limbo.Job was made; with limbo.Job(frozen=\"fixed\") or "
                                         "sync=\"diloco\" it is not trained: make it trainable before the job"
                                         % self._names[id(q)])
            self._groups = len(self.optimizer.param_groups)

    def _reseat_buffers(self):
        """A buffer the model reassigned (self.ema = 0.9 * self.ema + ...,
        in forward or anywhere in the loop): its new values go into the
        buffer the job took, which goes back in its place, so the job
        averages, saves and hands to joiners what the model holds. Run
        after every forward of the model (a forward hook: before the
        reduction averages the buffers) and at the end of each batch."""
        for m, n, b in self._buffer_refs:
            now = m._buffers.get(n)
            if now is b:
                continue
            if now is None or not torch.is_tensor(now) or now.shape != b.shape or now.dtype != b.dtype:
                raise UsageError(
                    "buffer %r of %s was reassigned after limbo.Job took the model with %s where it held %s %s; "
                    "the job keeps a buffer's shape and dtype (it averages, saves and hands it to joiners): "
                    "assign values of the same shape and dtype, or register the buffer as it will be before "
                    "the job" % (n, type(m).__name__, "None" if now is None else "%s %s" % (
                        getattr(now, "dtype", type(now).__name__), tuple(getattr(now, "shape", ()))),
                        b.dtype, tuple(b.shape)))
            with torch.no_grad():
                b.copy_(now)
            m._buffers[n] = b

    def _end_of_batch(self):
        self._check_model()
        if self._rollback is not None:
            self._restore_light(self._rollback)
            self._rollback = None
        if self._committed:
            self._committed = False
            self._check_schedulers()
            self._after_commit()

    @contextlib.contextmanager
    def no_sync(self):
        """Backwards inside add to this member's gradient without reducing it
        (DDP's no_sync): micro-batches by hand, or an auxiliary loss's
        backward, before the step's last backward outside it, which reduces
        the sum."""
        self._core.no_sync(True)
        try:
            yield
        finally:
            self._core.no_sync(False)

    def backward(self, loss):
        """loss.backward(), with the gradient reduced across the group in
        buckets while backward runs. `loss` is this member's mean loss over
        its batch (with accumulate=K, called K times a step, each loss that of
        a micro-batch divided by K)."""
        if not torch.is_tensor(loss) or loss.numel() != 1:
            raise InvalidInput("job.backward() takes the scalar loss tensor of this member's batch")
        value = float(loss.detach())
        self._core.backward_starts(value, self._rate())
        self._loss = value if self._loss is None else self._loss + value
        loss.backward()

    def step(self):
        """The optimizer's step with the group's gradient, committed on every
        member, then the scheduler's step. Returns whether it committed:
        False when a member failed (the group re-formed and the batch is dealt
        again); skip what counts steps then. A member asked to leave (SIGTERM,
        Ctrl-C, Slurm's warning) commits its step and leaves at the next
        batch: job.batches() ends. With sync="diloco" it is an inner step on
        this member alone (True once applied); the outer step, which commits,
        follows the share's last batch inside job.batches()."""
        if not self._core.in_step:
            raise UsageError("job.step() outside the training loop: call it for a batch of "
                             "`for batch in job.batches(loader)`, once a batch")
        loss = self._loss if self._loss is not None else float("nan")
        self._loss = None
        self._stepped = True
        return self._stepped_core(self._core.step(loss, self._rate()))

    def _stepped_core(self, done):
        """After the core's step (1 committed, 2 DiLoCo's inner step, 0 not)."""
        if not done:
            # What the user changes after a step that did not commit (a
            # scheduler stepped, `state` updated) is undone at the next batch.
            self._rollback = self._save_light()
            return False
        if self._scheduler_every == "step" or (self._scheduler_every == "epoch" and done == 1
                                               and self._core.cursor[1] == 0):
            for sc in self._schedulers:
                sc.step()
        self._scheduler_marks = [getattr(sc, "last_epoch", None) for sc in self._schedulers]
        if done == 1:
            self._committed = True
            self._epoch_ended = self._core.cursor[1] == 0  # for the loop's code after job.step()
        return True

    def _check_schedulers(self):
        if self._scheduler_every == "manual" or self._scheduler_marks is None:
            return
        for sc, mark in zip(self._schedulers, self._scheduler_marks):
            if getattr(sc, "last_epoch", None) != mark:
                raise UsageError("the scheduler %s was stepped outside the job, which steps it after every "
                                 "committed %s (scheduler_every=%r): step it only yourself with "
                                 "scheduler_every=\"manual\", or leave it to the job"
                                 % (type(sc).__name__, "step" if self._scheduler_every == "step" else
                                    "step that ends an epoch", self._scheduler_every))

    def _after_commit(self):
        """After a committed step (sync="diloco": an outer step): the epoch's
        end, checkpoints, the progress line, an agreed membership change."""
        self._epoch_ended = self._core.cursor[1] == 0
        steps = self._core.steps
        if self._epoch_ended and self._checkpoint_epochs > 0 and self._core.cursor[0] % self._checkpoint_epochs == 0:
            self._core.checkpoint("epoch %d" % self._core.cursor[0])
        if self._checkpoint_steps > 0 and steps % self._checkpoint_steps == 0:
            self._core.checkpoint("step %d" % steps)
        if self._progress and self._core.rank == 0 and (steps % self._log_every == 0 or self._epoch_ended):
            print("limbo: step %d epoch %.2f loss %.4f workers %d" % (steps, self._core.epoch,
                                                                   self._core.last_loss, self._core.world),
                  file=sys.stderr, flush=True)
        self._core.after_step()

    def _rate(self):
        """Limbo's optimizer: this step's scheduled rate (before the batch policy)."""
        if not self._own:
            return 0.0
        f = self._lr_schedule(self._core.steps) if self._lr_schedule is not None else 1.0
        return self.optimizer.lr * float(f)

    def evaluate(self, fn, data, *, size=None, batch_size=256, **loader_args):
        """Evaluation across the members: each evaluates its share of `data`
        (every sample once across the group) and every member gets the
        group's sums, the same on each. `fn(batch)` returns a dict of
        numbers to add up (a loss summed over the batch, correct
        predictions, the count): divide them yourself. `data` is a map-style
        Dataset (a DataLoader over this member's share is made with
        `loader_args`: collate_fn, num_workers, ...) or a function of a list
        of sample ids (then give `size`). Call it on every member at the
        same point (after a committed step: `if job.step() and
        job.epoch_ended:`, or after the loop). A member lost meanwhile: the
        group re-forms and the evaluation is done again by the new one;
        after training is over, when the group can no longer re-form, the
        survivors evaluate the whole set each. Runs under torch.no_grad()
        with the model in eval mode (its mode is put back)."""
        fetch = data if callable(data) and not hasattr(data, "__getitem__") else None
        n = size if size is not None else (len(data) if fetch is None else None)
        if not isinstance(n, int) or n < 1:
            raise InvalidInput("job.evaluate(): the data set's size is needed (a Dataset with len(), or size= "
                               "with a function of the ids), got %r" % (n,))
        if batch_size < 1:
            raise InvalidInput("job.evaluate(): batch_size must be at least 1, got %r" % (batch_size,))
        keys = None

        def over(lo, hi):
            nonlocal keys
            totals = {}
            batches = [list(range(i, min(i + batch_size, hi))) for i in range(lo, hi, batch_size)]
            if fetch is not None:
                source = (fetch(ids) for ids in batches)
            else:
                source = torch.utils.data.DataLoader(data, batch_sampler=batches, **loader_args) if batches else []
            for batch in source:
                out = fn(batch)
                if not isinstance(out, dict):
                    raise InvalidInput("job.evaluate(): fn(batch) must return a dict of numbers to sum, got %s"
                                       % type(out).__name__)
                for k, v in out.items():
                    totals[k] = totals.get(k, 0.0) + float(v)
            if keys is None:
                keys = sorted(totals)
            elif batches and sorted(totals) != keys:
                raise InvalidInput("job.evaluate(): fn returned other keys for another batch (%s, then %s)"
                                   % (keys, sorted(totals)))
            return totals

        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                while True:
                    if self._core.left or not self._started:  # no group: the whole set here
                        return over(0, n)
                    lo, hi = self._core.eval_share(n)
                    mine = over(lo, hi)
                    if keys is None:  # an empty share: the keys from one sample, counted as nothing
                        mine = {k: 0.0 for k in over(0, 1)}
                    got = self._core.eval_reduce([mine[k] for k in keys], self._ended)
                    if got is not None:
                        return dict(zip(keys, got))
                    if self._ended:  # after training a lost member is not replaced: the whole set here
                        return over(0, n)
        finally:
            self.model.train(was_training)

    def optimizer_state(self):
        """Limbo's optimizer: its state tensors by name (whole: gathered from
        the shards, so every member must call it at the same step) and its
        update count as "step"."""
        if not self._own:
            raise UsageError("optimizer_state() is for limbo.Optimizer; a torch.optim optimizer has state_dict()")
        return self._core.optimizer_state()

    @property
    def loss(self):
        """The group's mean loss of the last committed step."""
        return self._core.last_loss

    def log(self, **metrics):
        """Numbers to add to the next metrics line (metrics.jsonl, the status page)."""
        self._core.log(metrics)

    def record(self, kind="eval", **fields):
        """A record of its own in metrics.jsonl now (e.g. an evaluation)."""
        self._core.record(kind, fields)

    def finish(self, **results):
        """After the loop: the final checkpoint and summary.json (with
        `results`, e.g. test_accuracy=...), written once per storage. Returns
        the summary (None on a member that left before the end)."""
        _unfinished.discard(self)
        if self._finished:
            return self._summary
        if not self._ended:
            if self._core.left or not self._started:
                return None
            raise UsageError("job.finish() before training completed: run the loop of job.batches() to its end")
        self._finished = True
        self._summary = json.loads(self._core.finish(results))
        return self._summary

    # -- state that travels --------------------------------------------------
    def _pack(self):
        buf = io.BytesIO()
        scheds = [sc.state_dict() for sc in self._schedulers]
        torch.save({"optimizer": None if self._own else self.optimizer.state_dict(),
                    "groups": None if self._own else [[self._names[id(p)] for p in g["params"]]
                                                      for g in self.optimizer.param_groups],
                    "trainable": [n for n, p in self._in_flat if p.requires_grad],
                    "scheduler": scheds[0] if len(scheds) == 1 else (scheds or None),
                    "state": self.state, "frozen": {n: p.detach() for n, p in self._frozen},
                    "first_world": self._first_world}, buf)
        return buf.getbuffer()  # a view: the core copies it once

    def _load_schedulers(self, saved):
        if saved is None or not self._schedulers:
            return
        saved = saved if isinstance(saved, list) else [saved]
        for sc, st in zip(self._schedulers, saved):
            sc.load_state_dict(st)

    def _unpack(self, data):
        saved = torch.load(io.BytesIO(data))
        if saved.get("trainable") is not None and self._may_train:
            trainable = set(saved["trainable"])
            for n, p in self._in_flat:
                p.requires_grad_(n in trainable)
        if not self._own:
            groups = saved.get("groups") or []
            if len(groups) > len(self.optimizer.param_groups):  # groups the loop added later
                by_name = {n: p for p, n in ((p, self._names[id(p)]) for p in self.model.parameters())}
                for names, g in zip(groups[len(self.optimizer.param_groups):],
                                    saved["optimizer"]["param_groups"][len(self.optimizer.param_groups):]):
                    self.optimizer.add_param_group(
                        dict({k: v for k, v in g.items() if k != "params"}, params=[by_name[n] for n in names]))
                self._groups = len(self.optimizer.param_groups)
            self.optimizer.load_state_dict(saved["optimizer"])
        self._load_schedulers(saved.get("scheduler"))
        self.state.clear()
        self.state.update(saved["state"])
        if saved.get("first_world"):
            self._first_world = saved["first_world"]
        frozen = saved.get("frozen") or {}
        with torch.no_grad():
            for n, p in self._frozen:
                if n in frozen:
                    p.copy_(frozen[n])

    def _save_light(self):
        """The user's state dict and schedulers as committed (small: kept
        after a step that did not commit, to undo what the loop does next)."""
        return copy.deepcopy(self.state), [copy.deepcopy(sc.state_dict()) for sc in self._schedulers]

    def _restore_light(self, saved):
        state, scheds = saved
        self.state.clear()
        self.state.update(state)
        self._load_schedulers(scheds)

    def _optimizer_step(self, multiplier):
        groups = self.optimizer.param_groups
        if not self.scale_lr or multiplier == 1.0:
            self.optimizer.step()
            return
        rates = [g["lr"] for g in groups]
        for g in groups:
            g["lr"] = g["lr"] * multiplier
        try:
            self.optimizer.step()
        finally:
            for g, lr in zip(groups, rates):
                g["lr"] = lr

    def _at_exit(self):
        # A loop that ran to its end without finish(): the final files are
        # still written (the launcher waits for them).
        if self._ended and not self._finished:
            try:
                self.finish()
            except Exception as e:  # noqa: BLE001 - reported, the interpreter is exiting
                print("limbo: the final checkpoint and summary could not be written: %s" % e, file=sys.stderr)

    def _describe(self, options):
        lines = ["# a Python training loop (limbo.Job)", "[job]"]
        for key in ("batch_size", "dataset_size", "epochs", "max_steps", "seed", "order", "drop_last",
                    "clip_grad_norm", "batch_policy", "lr_scaling", "reference_batch", "ramp_steps",
                    "overlap", "bucket_mb", "compression", "shares"):
            v = options[key]
            if isinstance(v, bool):
                v = "true" if v else "false"
            elif isinstance(v, str):
                v = '"%s"' % v
            lines.append("%s = %s" % (key, v))
        lines.append('model = "%s"' % type(self.model).__name__)
        lines.append('optimizer = "%s"' % (("limbo " + self.optimizer.algorithm) if self._own
                                           else type(self.optimizer).__name__))
        return "\n".join(lines) + "\n"


# Jobs whose training ended without job.finish(): held until the exit,
# which writes their final checkpoint and summary (the launcher waits for
# them). Any other Job is freed when the program drops it.
_unfinished = set()


def load_checkpoint(path):
    """A Limbo checkpoint (`RUN_DIR/checkpoint.pt`, from `limbo train`, `limbo
    launch` or a `limbo.Job`) as PyTorch tensors: {"model": a state_dict with
    the model's dotted names, "optimizer": its state by name, flat over the
    trainable parameters (absent before the first update), "optimizer_steps",
    "step", "epoch", "position", "samples"}. A fully sharded checkpoint
    (shard="full") is put together from the shard files beside it, which
    must all be there (each member wrote its own)."""
    import torch
    ckpt = torch.jit.load(path, map_location="cpu")
    sd = ckpt.state_dict()

    def number(key):
        return int(sd[key].reshape(-1)[0])

    out = {"step": number("state.step"), "epoch": number("state.epoch"), "position": number("state.position"),
           "samples": number("state.samples"), "optimizer_steps": number("optim.step") if "optim.step" in sd else 0}
    model = {k[len("model."):]: v for k, v in sd.items() if k.startswith("model.")}
    state_names = ("momentum_buffer", "exp_avg", "exp_avg_sq")
    optimizer = {n: sd["optim." + n] for n in state_names if "optim." + n in sd}
    if "sharded.world" in sd:
        world, numel = number("sharded.world"), number("sharded.numel")
        names = bytes(sd["sharded.names"].tolist()).decode().split("\n")[:-1]
        offsets = sd["sharded.offsets"].tolist()
        shapes = {}
        for line in bytes(sd["state.model_description"].tolist()).decode().splitlines():
            kind, rest = line.split(" ", 1)
            name, shape = rest.split("[", 1)
            dims = shape.split("]", 1)[0]
            shapes[name] = [int(x) for x in dims.split(",") if x.strip()]
        flat = torch.empty(numel)
        state = {}
        for r in range(world):
            shard_path = "%s.shard-%d-of-%d.step-%d" % (path, r, world, out["step"])
            if not os.path.exists(shard_path):
                raise InvalidInput("checkpoint %r is sharded in %d and its shard %d (%r) is not beside it"
                                   % (path, world, r, shard_path))
            shard = torch.jit.load(shard_path, map_location="cpu").state_dict()
            lo, hi = int(shard["lo"][0]), int(shard["hi"][0])
            flat[lo:hi] = shard["weights"]
            if r == 0:
                out["optimizer_steps"] = int(shard["optimizer_steps"][0])
            for n in state_names:
                if n in shard:
                    state.setdefault(n, torch.zeros(numel))[lo:hi] = shard[n]
        for name, (offset, count) in zip(names, offsets):
            model[name] = flat[offset:offset + count].view(shapes.get(name, [count])).clone()
        optimizer = state
    out["model"] = model
    out["optimizer"] = optimizer
    return out


@atexit.register
def _finish_at_exit():
    for job in list(_unfinished):
        job._at_exit()
