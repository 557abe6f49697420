"""Shared by the benchmark scripts: run a limbo command in a fresh run
directory and return its summary.json; two "hosts" as network namespaces."""
import json
import os
import shutil
import signal
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


class Veth:
    """Two network namespaces joined by a veth pair: 10.232.T.1 and .2."""

    def __init__(self):
        # The first namespace is the claim on a tag (`ip netns add` fails
        # when it exists): two benchmarks at once never share names.
        first = os.getpid() % 200
        for k in range(200):
            t = (first + k) % 200 + 20
            if subprocess.run(["ip", "netns", "add", f"limbo-bench-a{t}"], stderr=subprocess.DEVNULL).returncode == 0:
                break
        else:
            raise RuntimeError("cannot create a network namespace (every tag is taken, or not root)")
        self.ns = [f"limbo-bench-a{t}", f"limbo-bench-b{t}"]
        self.ip = [f"10.232.{t}.1", f"10.232.{t}.2"]
        va, vb = f"lba{t}", f"lbb{t}"
        self.dev = [va, vb]
        subprocess.run(["ip", "netns", "del", self.ns[1]], stderr=subprocess.DEVNULL)  # a stale one
        cmds = [f"ip netns add {self.ns[1]}",
                f"ip link add {va} type veth peer name {vb}",
                f"ip link set {va} netns {self.ns[0]}", f"ip link set {vb} netns {self.ns[1]}",
                f"ip -n {self.ns[0]} addr add {self.ip[0]}/24 dev {va}",
                f"ip -n {self.ns[1]} addr add {self.ip[1]}/24 dev {vb}",
                f"ip -n {self.ns[0]} link set {va} up", f"ip -n {self.ns[1]} link set {vb} up",
                f"ip -n {self.ns[0]} link set lo up", f"ip -n {self.ns[1]} link set lo up"]
        try:
            for c in cmds:
                subprocess.run(c.split(), check=True)
        except subprocess.CalledProcessError:
            self.close()
            raise

    def prefix(self, rank):
        return ["ip", "netns", "exec", self.ns[rank]]

    def pids(self, rank):
        """Every process in host `rank`'s namespace."""
        out = subprocess.run(["ip", "netns", "pids", self.ns[rank]], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def cut(self, rank):
        """Takes host `rank`'s link down: a partition (no RST, no FIN)."""
        subprocess.run(["ip", "-n", self.ns[rank], "link", "set", self.dev[rank], "down"], check=True)

    def close(self):
        for n in range(2):
            for p in self.pids(n):
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    try:
                        os.kill(p, sig)
                    except ProcessLookupError:
                        pass
        for n in self.ns:
            subprocess.run(["ip", "netns", "del", n], stderr=subprocess.DEVNULL)
