#!/usr/bin/env python3
"""Export round trip, run by ctest: Limbo trains a user's TorchScript module
and the built-in models, `limbo export --format torchscript` writes them, and
PyTorch for Python loads the files with torch.jit.load and must get the same
test loss and accuracy as `limbo eval` (no Limbo code involved).

usage: test_export_roundtrip.py LIMBO_BINARY
Exit code 77 (skipped) without python3-torch or the Fashion-MNIST package.
"""
import json
import os
import struct
import subprocess
import sys
import tempfile

try:
    import numpy as np
    import torch
except ImportError as e:  # pragma: no cover
    print(f"SKIP: {e}")
    sys.exit(77)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from make_fixtures import FMNIST, idx  # noqa: E402


def run(*args):
    r = subprocess.run(list(args), capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"FAILED: {' '.join(args)}\n{r.stdout}\n{r.stderr}")
    return r.stdout


def limbo_eval(limbo, ckpt):
    out = run(limbo, "eval", "--checkpoint", ckpt)
    return json.loads(out[out.index("{"):])


def check(name, module_path, x, y, expected):
    m = torch.jit.load(module_path)
    m.eval()
    with torch.no_grad():
        scores = m(x)
    loss = torch.nn.functional.cross_entropy(scores, y).item()
    acc = (scores.argmax(1) == y).double().mean().item()
    print(f"{name}: python loss {loss:.6f} acc {acc:.4f} | limbo eval loss {expected['test_loss']:.6f} "
          f"acc {expected['test_accuracy']:.4f}")
    assert abs(loss - expected["test_loss"]) < 1e-4 * max(1.0, loss), name
    assert abs(acc - expected["test_accuracy"]) <= 1.0 / len(y) + 1e-9, name
    return m


def main():
    limbo = os.path.abspath(sys.argv[1])
    if not os.path.exists(f"{FMNIST}/t10k-images-idx3-ubyte.gz"):
        print("SKIP: dataset-fashion-mnist is not installed")
        sys.exit(77)
    failures = 0
    with tempfile.TemporaryDirectory() as d:
        run(sys.executable, f"{HERE}/make_fixtures.py", d, "--train", "3000", "--test", "500")
        data = f"{d}/fmnist_npy"
        x_u8 = np.load(f"{data}/test_x.npy")
        y = torch.from_numpy(np.load(f"{data}/test_y.npy"))
        x = torch.from_numpy(x_u8.astype(np.float32) / 255.0)

        # 1. A user's module (BatchNorm, dropout): trained, exported, reloaded.
        run(limbo, "train", "--run-dir", f"{d}/user", "--set", "model.name=torchscript",
            "--set", f"model.path={d}/cnn_bn.pt", "--set", "data.dataset=tensors",
            "--set", f"data.path={data}", "--set", "train.epochs=1", "--set", "train.progress=false")
        ev = limbo_eval(limbo, f"{d}/user/checkpoint.pt")
        run(limbo, "export", "--checkpoint", f"{d}/user/checkpoint.pt", "--format", "torchscript",
            "--out", f"{d}/trained.pt")
        files = {"limbo.json": ""}
        m = torch.jit.load(f"{d}/trained.pt", _extra_files=files)
        original = torch.jit.load(f"{d}/cnn_bn.pt")
        assert m.original_name == original.original_name, "the user's class is kept"
        assert list(m.state_dict()) == list(original.state_dict()), "the same parameter and buffer names"
        assert not torch.equal(m.state_dict()["conv1.weight"], original.state_dict()["conv1.weight"]), \
            "trained weights differ from the initial ones"
        assert m.state_dict()["bn1.running_var"].ne(1).any(), "BatchNorm statistics were trained"
        assert json.loads(files["limbo.json"])["model"] == "torchscript"
        check("user cnn_bn", f"{d}/trained.pt", x, y, ev)

        # 2. Built-in models: a generated module takes [0, 1] pixels and normalises itself.
        xi = torch.from_numpy(idx(f"{FMNIST}/t10k-images-idx3-ubyte.gz")[:500, None].astype(np.float32) / 255.0)
        yi = torch.from_numpy(idx(f"{FMNIST}/t10k-labels-idx1-ubyte.gz")[:500].astype(np.int64))
        for model, steps in (("lenet", "200"), ("mlp", "200"), ("cifar-quick", "30"), ("resnet20", "30")):
            run_dir = f"{d}/{model}"
            run(limbo, "train", "--run-dir", run_dir, "--set", f"model.name={model}", "--set",
                "data.train_limit=3000", "--set", "data.test_limit=500", "--set", f"train.max_steps={steps}",
                "--set", "train.progress=false")
            ev = limbo_eval(limbo, f"{run_dir}/checkpoint.pt")
            run(limbo, "export", "--checkpoint", f"{run_dir}/checkpoint.pt", "--out", f"{d}/{model}.pt")
            try:
                check(model, f"{d}/{model}.pt", xi, yi, ev)
            except AssertionError as e:
                print(f"FAILED: {e}")
                failures += 1

        # 3. safetensors export keeps working, with the checkpoint's names.
        run(limbo, "export", "--checkpoint", f"{d}/lenet/checkpoint.pt", "--out", f"{d}/lenet.safetensors")
        with open(f"{d}/lenet.safetensors", "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
        assert "conv1.weight" in header and header["conv1.weight"]["dtype"] == "F32", header.keys()
        lenet = torch.jit.load(f"{d}/lenet.pt")
        names = set(lenet.state_dict()) - {"input_mean", "input_std"}
        assert names == set(header) - {"__metadata__"}, (names, header.keys())
    if failures:
        sys.exit(1)
    print("OK")


if __name__ == "__main__":
    main()
