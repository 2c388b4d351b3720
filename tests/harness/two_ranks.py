"""A training entry point on two CPU processes through accelerate's own test launcher (`accelerate.debug_launcher`:
forked ranks joined with gloo over a file rendezvous), as `accelerate launch --config_file
conf/accelerate/cpu_2proc.yaml <entry point>` (`real_launch` below) runs it minus a fresh interpreter's imports per
rank:

    python tests/harness/two_ranks.py <script.py | -m module> <args>

Run in a child of a warm Python (harness/warm_python.py, `fast_launch` below), each rank is a fork of a process
that has imported torch, transformers and selfspec once. What the real launch gives a rank, each rank has: one
intra-op thread (accelerate launch sets OMP_NUM_THREADS=1 for several processes), a gloo process group, and
the entry point run as `__main__` with its argv. tests/train/test_fsdp.py checks that a run here ends on the head
a real `accelerate launch` of the same run ends on, bit for bit."""

from __future__ import annotations

import os
import runpy
import signal
import subprocess
import sys
import tempfile
from pathlib import Path


def _rank(entry: list[str]) -> None:
    import ctypes

    import torch

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: a launcher killed at its timeout takes its ranks
    torch.set_num_threads(1)
    if entry[0] == "-m":
        sys.argv = [entry[1], *entry[2:]]
        runpy.run_module(entry[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(entry)
        sys.path[0] = os.path.dirname(os.path.abspath(entry[0]))
        runpy.run_path(entry[0], run_name="__main__")


def main(argv: list[str]) -> int:
    from accelerate import debug_launcher
    from torch.multiprocessing import ProcessExitedException

    try:
        debug_launcher(_rank, args=(argv,), num_processes=2)
    except ProcessExitedException as e:  # a rank's own exit code (sys.exit(2) on a UserError), as torchrun passes
        return e.exit_code or 1
    return 0


def fast_launch(python, entry: list[str], cwd, timeout: float = 300) -> subprocess.CompletedProcess:
    """`accelerate launch` of `entry` on two CPU processes, forked from `python` (a WarmPython): the result as
    subprocess.run(..., capture_output=True, text=True) gives it."""
    with tempfile.TemporaryDirectory(prefix="selfspec-ranks-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        child = python.start(__file__, entry, cwd, env, out, err, timeout)
        code = child.wait()
        if code == -signal.SIGKILL:  # past `timeout`: the warm Python killed it
            raise subprocess.TimeoutExpired(entry, timeout)
        return subprocess.CompletedProcess(entry, code, out.read_text(), err.read_text())


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def real_launch(entry: list[str], cwd, timeout: float = 600) -> subprocess.CompletedProcess:
    """The same two processes through a real `accelerate launch` (torchrun): what users run."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "conf/accelerate/cpu_2proc.yaml",
           "--main_process_port", str(free_port()), *entry]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def head_digests(run: subprocess.CompletedProcess) -> set[str]:
    """The head digests the ranks printed (`[train] rank R head sha256 D`): one element when they agree."""
    return {line.split()[-1] for line in run.stdout.splitlines() if "head sha256" in line}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
