"""Fully sharded training from Python (limbo.Job(shard="full"),
docs/sharded_state.md): each member holds its shard of the weights, of the
gradient and of the optimizer state; units are gathered for their forward
and backward and given back.

Run by CTest (tests/CMakeLists.txt) with LIMBO_BINARY and LIMBO_PYTHON_DIR.
The losses, the joins and the kills are in test_python_job.py (the same
guarantees as every other mode, checked by the same tests).
"""
import os
import subprocess
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
LIMBO = os.environ.get("LIMBO_BINARY", os.path.join(ROOT, "build", "src", "cli", "limbo"))
PYDIR = os.environ.get("LIMBO_PYTHON_DIR", os.path.join(ROOT, "build", "python"))
SCRIPT = os.path.join(HERE, "shard_script.py")

sys.path.insert(0, PYDIR)
import torch  # noqa: E402
import limbo  # noqa: E402


def run(nproc, shard, *args, run_dir=None, resume=False, launch=(), ending=None):
    """The script under `limbo launch`; every member's results (the `ending`
    members' of the last group when that differs)."""
    out = tempfile.mkdtemp(prefix="limbo-fs-")
    e = dict(os.environ)
    e["PYTHONPATH"] = PYDIR + (":" + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    for k in ("LIMBO_RDZV", "LIMBO_ELASTIC", "LIMBO_RANK", "LIMBO_WORLD", "LIMBO_RUN_DIR", "LIMBO_RESUME"):
        e.pop(k, None)
    cmd = [LIMBO, "launch", "--nproc", str(nproc), "--run-dir", run_dir or os.path.join(out, "run")] + \
        list(launch) + (["--resume"] if resume else []) + ["--", sys.executable, SCRIPT, "--shard", shard, "--out", out] + list(args)
    r = subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return [torch.load(os.path.join(out, "rank%d.pt" % i)) for i in range(ending or nproc)]


@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_a_gradient_that_is_not_finite_on_one_member_skips_the_step_everywhere(clip):
    """One parameter's gradient is NaN on one member at step 5 (its loss
    finite): fully sharded, the members
    agree on it before any home is written (their shards' verdicts, or the
    clipping norm's sum), every member skips the step, and the run ends with
    the replicated path's weights and losses (which skips it alike)."""
    args = ["--optimizer", "adamw", "--clip", str(clip), "--nan-step", "4", "--nan-rank", "1"]
    whole = run(2, "none", *args)
    full = run(2, "full", *args)
    for name, w in whole[0]["weights"].items():
        assert torch.isfinite(w).all(), name
        for member in full:
            if clip == 0:
                assert torch.equal(member["weights"][name], w), name
            else:
                assert (member["weights"][name] - w).abs().max() <= 1e-3 * max(w.abs().max().item(), 1e-6), name
    assert len(full[0]["losses"]) == len(whole[0]["losses"])


def test_a_step_a_member_died_in_touches_no_more_memory_than_a_step_that_commits():
    """A member SIGKILLed between two steps: the survivors' next step fails
    in its forward's first gather, and the rest of their forward and
    backward runs for nothing. Its gradient's buckets give their pages back
    as backward fills them (fully sharded, the whole gradient would not fit
    a member meant for a shard of it), and the reduction's end scales none
    of them: the failed step's peak stays below that of a step that
    commits, which keeps this member's shard of the gradient. (It once
    scaled every failed bucket at backward's end, touching the whole
    gradient again: members under a memory limit were killed by the OOM
    killer there.)"""
    got = run(3, "full", "--width", "512", "--blocks", "8", "--samples", "384", "--die-step", "4",
              "--die-rank", "1", launch=["--min-workers", "2"], ending=2)
    grad_bytes = 4 * got[0]["params"]
    for member in got:
        g = member["growth"]
        assert set(g) == {"committed", "failed"}, g
        # A step that commits holds its shard of the gradient (a third) and
        # more; the failed one, without the fix, the whole gradient.
        assert g["failed"] < g["committed"] + 0.25 * grad_bytes, (g, grad_bytes)
        # 4 steps of 3 x 16 samples, then the rest of the epoch's 384 at 2 x 16
        assert len(member["losses"]) == 4 + (384 - 4 * 48) // 32
        assert member["losses"] == got[0]["losses"]


@pytest.mark.parametrize("optimizer,nproc,clip", [("adamw", 2, 0.0), ("sgd", 3, 0.0), ("adamw", 3, 0.5)])
def test_fully_sharded_training_equals_the_replicated_path(optimizer, nproc, clip):
    """The same batches, replicated and fully sharded: the same losses and
    weights bit for bit (every addition of the gradient sum and every update
    is the replicated path's); with clipping the norm is summed from the
    shards in another order, so within float32 rounding of the coefficient.
    Between steps a fully sharded member holds none of a unit's weights but
    the pages its shard shares (they read as zeros); job.full_state_dict()
    in the middle of training, and the model after training, are whole on
    every member."""
    args = ["--optimizer", optimizer, "--clip", str(clip)]
    whole = run(nproc, "none", *args)
    full = run(nproc, "full", *args)
    assert len(full[0]["losses"]) == -(-512 // (16 * nproc))  # the last batch of the epoch may be short
    for name, w in whole[0]["weights"].items():
        for member in full:
            got = member["weights"][name]
            if clip == 0:
                assert torch.equal(got, w), name
            else:
                assert (got - w).abs().max() <= 1e-3 * max(w.abs().max().item(), 1e-6), name
    if clip == 0:
        assert full[0]["losses"] == whole[0]["losses"]
    else:
        assert full[0]["losses"] == pytest.approx(whole[0]["losses"], rel=1e-3)
    assert full[0]["losses"][-1] < 0.5 * full[0]["losses"][0]  # it learns
    # job.full_state_dict() in the middle of training: the whole model on
    # every member, the replicated path's (and training goes on after it).
    for member in full:
        for name, w in whole[0]["middle"].items():
            if clip == 0:
                assert torch.equal(member["middle"][name], w), name
            else:
                assert (member["middle"][name] - w).abs().max() <= 1e-3 * max(w.abs().max().item(), 1e-6), name
    # A unit's weights between steps: all there replicated, only the
    # boundary pages of a member's shard when fully sharded.
    assert min(whole[0]["held"]) == 1.0
    for member in full:
        assert max(member["held"]) < 0.1, member["held"]


def test_fully_sharded_refusals_say_why():
    """Combinations that cannot work are refused when the job is made."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(limbo.InvalidInput, match="limbo.Optimizer"):
        limbo.Job(model, sgd, dataset=8, batch_size=2, shard="full")
    own = limbo.Optimizer("adamw", lr=1e-3)
    with pytest.raises(limbo.InvalidInput, match="sync"):
        limbo.Job(model, own, dataset=8, batch_size=2, shard="full", sync="diloco")
    with pytest.raises(limbo.InvalidInput, match="shard must be"):
        limbo.Job(model, own, dataset=8, batch_size=2, shard="weights")
    with pytest.raises(limbo.InvalidInput, match="no submodule"):
        limbo.Job(model, own, dataset=8, batch_size=2, shard="full", units=["blocks.0"])
    with pytest.raises(limbo.InvalidInput, match="units= cuts"):
        limbo.Job(model, own, dataset=8, batch_size=2, units=["0"])


@pytest.mark.parametrize("first,then", [("full", "full"), ("none", "full"), ("full", "none"), ("full", "state")])
def test_a_fully_sharded_checkpoint_resumes_into_another_world_size(first, then):
    """An epoch on 2 members, its checkpoint resumed by 3 for a second epoch:
    fully sharded, or switching between replicated and fully sharded across
    the resume; the end is the replicated path's with the same schedule,
    bit for bit. A fully sharded run's checkpoint is a file per shard,
    each written by its member, beside a file that names them:
    limbo.load_checkpoint() puts the whole model together from them, the
    first epoch's weights, bit for bit."""
    def two_epochs(a, b):
        d = tempfile.mkdtemp(prefix="limbo-fs-resume-")
        first_epoch = run(2, a, "--epochs", "1", run_dir=d)
        ckpt = os.path.join(d, "checkpoint.pt")
        shards = sorted(f for f in os.listdir(d) if f.startswith("checkpoint.pt.shard-"))
        loaded = limbo.load_checkpoint(ckpt)
        if a == "full":
            assert shards == ["checkpoint.pt.shard-%d-of-2.step-%d" % (r, loaded["step"]) for r in range(2)], shards
            assert os.path.getsize(ckpt) < min(os.path.getsize(os.path.join(d, f)) for f in shards)
        else:
            assert shards == []
        for name, w in first_epoch[0]["weights"].items():
            assert torch.equal(loaded["model"][name], w), name
        assert set(loaded["optimizer"]) == {"exp_avg", "exp_avg_sq"}
        return run(3, b, "--epochs", "2", run_dir=d, resume=True)
    want = two_epochs("none", "none")
    got = two_epochs(first, then)
    assert len(got[0]["losses"]) == -(-512 // 48)  # the second epoch's steps, at 3 members
    for member in got:
        for name, w in want[0]["weights"].items():
            assert torch.equal(member["weights"][name], w), name
    assert got[0]["losses"] == want[0]["losses"]


def test_a_resume_reads_each_members_state_from_the_shard_files_and_never_holds_it_whole():
    """A fully sharded elastic job resumed from its checkpoint: the
    optimizer state stays in the checkpoint's shard files, and the group's
    first re-sharding reads from them the ranges each new home needs, so a
    member never puts the whole state together (it did: a job under a
    memory limit of half its state could not resume). The making of the
    job (the resume's load and that re-sharding) grows a resumed member's
    peak by a fresh start's growth plus its home's share of the state (a
    fresh start's comes with its first update), not by the whole state;
    and the resumed run ends where an uninterrupted one does, bit for bit."""
    args = ["--width", "384", "--blocks", "8", "--samples", "256", "--watch-start"]
    elastic = ["--min-workers", "4"]
    d = tempfile.mkdtemp(prefix="limbo-fs-resume-")
    first = run(4, "full", *args, "--epochs", "1", run_dir=d, launch=elastic)
    resumed = run(4, "full", *args, "--epochs", "2", run_dir=d, resume=True, launch=elastic)
    whole = run(4, "full", *args, "--epochs", "2", launch=elastic)
    state_bytes = 8 * first[0]["params"]  # AdamW's two moments, whole
    fresh = sorted(m["growth"]["start"] for m in first)
    again = sorted(m["growth"]["start"] for m in resumed)
    # A quarter of the state is each member's home's; before, every member
    # also held the whole state (and more) while it loaded.
    base = fresh[len(fresh) // 2]
    for g in again:
        assert g < base + 0.5 * state_bytes, (again, fresh, state_bytes)
    assert resumed[0]["losses"] == whole[0]["losses"][len(first[0]["losses"]):]
    for member in resumed:
        for name, w in whole[0]["weights"].items():
            assert torch.equal(member["weights"][name], w), name


@pytest.mark.parametrize("shard", ["none", "full"])
def test_a_checkpoint_holds_a_buffers_elements_not_the_region_it_lives_in(shard):
    """A float32 buffer lives in Limbo's flat region beside the whole
    gradient, and an archive writes a tensor's whole storage: each
    checkpoint held a copy of the gradient (fully sharded: checkpoint.pt,
    meant to hold the buffers and the layout, was the size of the weights,
    and a resume loaded it whole). Now a buffer is written as its own
    elements: replicated, the file holds the weights, AdamW's two moments
    and little more; fully sharded, far less than the weights."""
    d = tempfile.mkdtemp(prefix="limbo-fs-buffer-")
    got = run(2, shard, "--width", "256", "--blocks", "4", "--samples", "64", "--buffer", run_dir=d)
    weights = 4 * got[0]["params"]
    size = os.path.getsize(os.path.join(d, "checkpoint.pt"))
    if shard == "none":
        assert size < 3.25 * weights, (size, weights)  # weights + 2 moments; the gradient was a 4th
    else:
        assert size < 0.25 * weights, (size, weights)
    loaded = limbo.load_checkpoint(os.path.join(d, "checkpoint.pt"))
    assert torch.equal(loaded["model"]["scale"], torch.ones(256))
    for name, w in got[0]["weights"].items():
        assert torch.equal(loaded["model"][name], w), name
