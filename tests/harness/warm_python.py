"""A Python that has imported torch, transformers and selfspec's modules once, and runs each entry point it is
asked for in a forked child: a real process with its own exit code, stderr, working directory and environment, as
`python <script> <args>` would run it, minus the seconds of imports every fresh interpreter pays.

    python tests/harness/warm_python.py [--no-preload]    # then a JSON request a line on stdin, a reply on stdout

Request: {"script", "args", "cwd", "env", "stderr", "timeout"} and optionally "stdout", "stdin", "append" and
"notify"; the child's fd 2 goes to the file `stderr`, fd 1 to the file `stdout` (else /dev/null), both truncated
unless "append", and its stdin comes from the file `stdin` (else /dev/null). Reply: {"pid"}
first where "notify" is true (the caller may SIGKILL the child), then {"returncode"} (negative: killed by that
signal; a child still running after `timeout` seconds is killed and the reply says {"timeout": true}).

The children share what was imported here, and nothing else: the warm Python imports modules and runs no code of
theirs, so each child starts as a fresh interpreter would after the same imports. Start it with the environment the
entry points need at import time (HF_HUB_OFFLINE=1): the modules read theirs once, here. A case that must patch a
library before anything imports it (bad_inputs' disk-full case) runs in a fresh interpreter instead.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import pkgutil
import queue
import resource
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

# What the entry points import on the way to their first error; a child imports anything else itself.
PRELOAD = ["torch", "numpy", "safetensors.torch", "omegaconf", "hydra", "hydra.core.config_store", "hydra.errors",
           "accelerate", "huggingface_hub", "datasets", "jinja2", "tqdm", "transformers", "transformers.modeling_utils",
           "transformers.models.auto.modeling_auto", "transformers.models.auto.tokenization_auto",
           "transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2",
           "transformers.models.gemma3.modeling_gemma3"]
# selfspec's library modules are imported too (compiling them is most of what a child would still pay where
# PYTHONDONTWRITEBYTECODE is set), but not its scripts: those are the entry points the children run.
SKIP = ("selfspec.scripts", "selfspec.conf")


def _child(request: dict) -> None:
    """Become `python <script> <args>`: its cwd, environment, streams, argv and sys.path[0]; run it; exit as the
    interpreter would (SystemExit's code or message, the traceback of an uncaught exception; then non-daemon
    threads joined, atexit handlers run, streams flushed) but without its final teardown, which frees every
    module's objects one by one: 2 s in a forked copy of torch, and nothing a case checks."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(os.open(request["stdin"], os.O_RDONLY) if request.get("stdin") else null, 0)
    # "append": write after what the files hold (a caller's own streams, as /proc/<pid>/fd/N), else start them anew
    flags = os.O_WRONLY | (os.O_APPEND if request.get("append") else os.O_CREAT | os.O_TRUNC)
    os.dup2(os.open(request["stdout"], flags, 0o644) if request.get("stdout") else null, 1)
    if request["env"].get("PYTHONUNBUFFERED"):  # near what the variable makes of a fresh interpreter's streams:
        for stream in (sys.stdout, sys.stderr):  # the same objects (libraries keep references), flushed by line
            stream.reconfigure(line_buffering=True, write_through=True)
    os.dup2(os.open(request["stderr"], flags, 0o644), 2)
    if request.get("file_limit") is not None:  # RLIMIT_FSIZE: a write past it fails with EFBIG (SIGXFSZ ignored)
        resource.setrlimit(resource.RLIMIT_FSIZE, (request["file_limit"], resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    script = request["script"]
    sys.argv = [script, *request["args"]]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def _exit_code(code) -> int:
    """What the interpreter makes of `sys.exit(code)`: None is 0, an int itself, anything else printed, then 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _wait(pid: int, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return {"returncode": os.waitstatus_to_exitcode(status)}
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return {"timeout": True}
        time.sleep(0.005)


def _preload() -> None:
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:  # an optional library or model family this install lacks: the child finds out itself
            pass
    import selfspec

    for module in pkgutil.walk_packages(selfspec.__path__, "selfspec.", onerror=lambda name: None):
        if not module.name.startswith(SKIP):
            try:
                importlib.import_module(module.name)
            except Exception:  # a module that does not import (now): the child that needs it meets its own error
                pass


def main() -> None:
    if "--no-preload" not in sys.argv:
        _preload()
    # What was imported lives as long as the children: freeze it out of the collector's reach, so a child's first
    # full collection walks only its own objects (else it walks torch's and transformers' millions, copying every
    # page it touches: most of a case's second), as Python's gc docs advise before fork().
    gc.collect()
    gc.freeze()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                _child(request)  # exits
            except BaseException:  # its setup failed (a cwd that is gone...): say why, and never loop on here
                traceback.print_exc()
            os._exit(1)
        if request.get("notify"):
            print(json.dumps({"pid": pid}), flush=True)
        print(json.dumps(_wait(pid, request["timeout"])), flush=True)


class WarmPython:
    """The harness's side: one warm interpreter answering one request at a time (one per worker thread)."""

    def __init__(self, env: dict, preload: bool = True):
        """`env`: the warm interpreter's environment (what the modules it preloads read at import, they read there).
        `preload=False`: a bare interpreter (the harness's own tests of this file)."""
        cmd = [sys.executable, os.path.abspath(__file__)] + ([] if preload else ["--no-preload"])
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
        self.ready = False
        self.child: Optional[WarmChild] = None  # the last child start() began

    def _reply(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the warm Python exited (code {self.proc.wait()}); its stderr is above")
        return json.loads(line)

    def _wait_ready(self) -> None:
        if not self.ready:
            self.ready = self._reply()["ready"]
        if self.child is not None:
            self.child.wait()  # one child at a time: its exit is the reply before the next request's

    def _send(self, script: str, args: list[str], cwd, env: dict, timeout: float, **streams) -> None:
        """One request (after the last child's exit), its streams as the module docstring says."""
        self._wait_ready()
        request = {"script": script, "args": list(args), "cwd": str(cwd), "env": env, "timeout": timeout, **streams}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()

    def _exit_code(self, script: str, args: list[str], timeout: float) -> int:
        """The child's exit code, from the reply to the last request; TimeoutExpired as subprocess.run."""
        reply = self._reply()
        if reply.get("timeout"):
            raise subprocess.TimeoutExpired([sys.executable, script, *args], timeout)
        return reply["returncode"]

    def run(self, script: str, args: list[str], cwd, env: dict, timeout: float,
            file_limit: Optional[int] = None) -> tuple[int, str]:
        """`python script *args` in `cwd` with `env` -> (exit code, stderr); TimeoutExpired as subprocess.run.
        `file_limit`: the bytes any file it writes may grow to (RLIMIT_FSIZE, set in the child before the script;
        its stderr is then a pipe, as a fresh interpreter's under subprocess.run, which no file limit cuts short)."""
        if file_limit is None:
            with tempfile.NamedTemporaryFile(mode="r", prefix="selfspec-stderr-", suffix=".txt") as err:
                self._send(script, args, cwd, env, timeout, stderr=err.name)
                return self._exit_code(script, args, timeout), err.read()
        read, write = os.pipe()
        text: list[str] = []
        reader = threading.Thread(target=lambda: text.append(os.fdopen(read, errors="replace").read()), daemon=True)
        reader.start()
        try:  # the child opens the pipe's write end by its /proc path (a pipe: O_CREAT and O_TRUNC do nothing)
            self._send(script, args, cwd, env, timeout, stderr=f"/proc/{os.getpid()}/fd/{write}", file_limit=file_limit)
            code = self._exit_code(script, args, timeout)
        finally:
            os.close(write)
        reader.join(timeout)
        return code, "".join(text)

    def exec_streams(self, script: str, args: list[str], cwd, env: dict, stdin: str, stdout: str, stderr: str,
                     timeout: float) -> int:
        """`python script *args` reading `stdin` and appending to `stdout` and `stderr` (paths; /proc/<pid>/fd/N
        for another process's own streams) -> its exit code (harness/warm_exec.py)."""
        self._send(script, args, cwd, env, timeout, stdin=stdin, stdout=stdout, stderr=stderr, append=True)
        return self._exit_code(script, args, timeout)

    def start(self, script: str, args: list[str], cwd, env: dict, stdout, stderr, timeout: float) -> "WarmChild":
        """`python script *args` started in a child writing its stdout and stderr to those files; returns at once
        with the child (poll, kill, wait: as a subprocess.Popen). The warm Python kills it after `timeout` s."""
        self._send(script, args, cwd, env, timeout, stdout=str(stdout), stderr=str(stderr), notify=True)
        self.child = WarmChild(self._reply()["pid"], self._reply)
        return self.child

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


class WarmChild:
    """A child of a warm Python, as far as a harness that kills processes needs: pid, poll(), kill(), wait(),
    returncode. Its exit is the warm Python's second reply, read by a thread (poll never blocks)."""

    def __init__(self, pid: int, reply):
        self.pid, self.returncode = pid, None
        self._exited = threading.Event()

        def read_exit() -> None:
            answer = reply()
            self.returncode = -signal.SIGKILL if answer.get("timeout") else answer["returncode"]
            self._exited.set()

        threading.Thread(target=read_exit, daemon=True).start()

    def poll(self):
        return self.returncode if self._exited.is_set() else None

    def kill(self) -> None:
        if not self._exited.is_set():
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:  # exited (the warm Python reaps it) between the check and the kill
                pass

    def wait(self) -> int:
        self._exited.wait()
        return self.returncode


def map_warm(fn: Callable, items, pythons: list[WarmPython]) -> list:
    """[fn(item, python) for item in items], len(pythons) calls at a time, each with a warm Python no other call
    holds (a warm Python answers one request at a time)."""
    idle: queue.Queue = queue.Queue()
    for python in pythons:
        idle.put(python)

    def one(item):
        python = idle.get()
        try:
            return fn(item, python)
        finally:
            idle.put(python)

    with ThreadPoolExecutor(max_workers=len(pythons)) as pool:
        return list(pool.map(one, items))


if __name__ == "__main__":
    main()
