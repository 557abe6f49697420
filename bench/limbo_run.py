"""Shared by the benchmark scripts: run a limbo command in a fresh run
directory and return its summary.json."""
import json
import os
import shutil
import subprocess
import tempfile


def summary_of(cmd_before_run_dir, cmd_after_run_dir):
    """Runs `cmd_before_run_dir --run-dir TMP cmd_after_run_dir` quietly; returns summary.json."""
    d = tempfile.mkdtemp(prefix="limbo-bench-")
    try:
        subprocess.run(list(cmd_before_run_dir) + ["--run-dir", d] + list(cmd_after_run_dir),
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(os.path.join(d, "summary.json")) as f:
            return json.load(f)
    finally:
        shutil.rmtree(d, ignore_errors=True)
