"""A file that runs as a Python interpreter for code that starts `[python, "-I", script, *args]` itself (selfspec's
vLLM worker client, target/vllm_worker.py), but forks the script from a warm Python (harness/warm_python.py) instead
of importing torch and transformers anew: seconds saved per start, the same process otherwise.

    with WarmExecutable(env) as python:     # env: the warm Pythons' environment (harness/warm_python.py)
        subprocess.run([python.path, "-I", "script.py", "arg"], ...)

`python.path` is a small script (sh exec'ing this venv's Python, isolated, no site: milliseconds) that sends its argv,
working directory, environment and pid over a Unix socket to a thread of this process, which hands them to an idle
warm Python (one is started with the executable; starts that overlap get more); the child opens the script's
streams as /proc/<pid>/fd/{0,1,2} (the pipes and files its caller gave it), and the little script exits with the
child's exit code. Linux only (/proc), like the warm Python's fork.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import sys
import tempfile
import threading
from pathlib import Path

from harness.warm_python import WarmPython

# The interpreter file: sh, so that any path works (a shebang line is split at spaces), exec'ing this venv's Python
# (same pid) on SHIM.
LAUNCHER = """#!/bin/sh
exec {python} -IS {shim} "$@"
"""
SHIM = """import json, os, socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect({sock!r})
s.sendall(json.dumps({{"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ), "pid": os.getpid()}})
          .encode() + b"\\n")
reply = json.loads(s.makefile().readline() or '{{"error": "the warm Python did not answer"}}')
if "error" in reply:
    sys.exit("warm executable: " + reply["error"])
code = reply["returncode"]
if code < 0:  # killed by a signal: so is this process, as the caller would see it
    os.kill(os.getpid(), -code)
sys.exit(code)
"""


def script_and_args(argv: list[str]) -> tuple[str, list[str]]:
    """`python [flags] script args` -> (script, args); flags that take no value are dropped (the child is a fork
    of a warm Python: -I, -S, -u... have nothing left to change); -c, -m and the rest are refused."""
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "-":
        if not set(argv[i][1:]) <= set("IsSEBuOqd"):
            raise ValueError(f"runs scripts only, with flags from -IsSEBuOqd; got {argv[i]!r}")
        i += 1
    if i == len(argv):
        raise ValueError(f"no script in {argv}")
    return argv[i], argv[i + 1:]


class WarmExecutable:
    """`path`: the interpreter file to hand to code that starts Pythons."""

    def __init__(self, env: dict, timeout: float = 600, preload: bool = True):
        self.env, self.timeout, self.preload = env, timeout, preload
        self._idle, self._busy, self._lock = [WarmPython(env, preload)], set(), threading.Lock()
        self.folder = Path(tempfile.mkdtemp(prefix="selfspec-warm-"))  # short: a socket path has ~100 bytes
        sock_path = str(self.folder / "warm.sock")
        self._server = socket.socket(socket.AF_UNIX)
        self._server.bind(sock_path)
        self._server.listen(8)
        (self.folder / "shim.py").write_text(SHIM.format(sock=sock_path))
        self.path = self.folder / "python"
        self.path.write_text(LAUNCHER.format(python=shlex.quote(sys.executable),
                                             shim=shlex.quote(str(self.folder / "shim.py"))))
        self.path.chmod(0o755)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn) -> None:
        with conn:
            try:
                reply = self._run(json.loads(conn.makefile().readline()))
            except Exception as e:  # noqa: BLE001 - the shim prints it and exits 1
                reply = {"error": f"{type(e).__name__}: {e}"}
            try:
                conn.sendall(json.dumps(reply).encode() + b"\n")
            except OSError:  # the interpreter file was killed meanwhile: nobody to tell
                pass

    def _run(self, request: dict) -> dict:
        script, args = script_and_args(request["argv"])
        with self._lock:  # a warm Python runs one child at a time: an idle one, or a new one
            warm = self._idle.pop() if self._idle else WarmPython(self.env, self.preload)
            self._busy.add(warm)
        fd = f"/proc/{request['pid']}/fd"
        try:
            code = warm.exec_streams(os.path.join(request["cwd"], script), args, request["cwd"], request["env"],
                                     stdin=f"{fd}/0", stdout=f"{fd}/1", stderr=f"{fd}/2", timeout=self.timeout)
        finally:
            with self._lock:
                self._busy.discard(warm)
                self._idle.append(warm)
        return {"returncode": code}

    def close(self) -> None:
        try:
            self._server.shutdown(socket.SHUT_RDWR)  # wakes the thread's accept()
        except OSError:
            pass
        self._server.close()
        self._thread.join(timeout=10)
        with self._lock:
            for warm in self._idle:
                warm.close()
            for warm in self._busy:  # a child its caller never closed: it goes on alone, as a fresh Python would
                warm.proc.kill()
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
