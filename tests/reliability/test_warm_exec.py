"""harness/warm_exec.py: a file that starts as `python [flags] script args` would, its script forked from a warm
Python: the caller's pipes as its streams, its exit code, starts that overlap, and a one-line refusal of what it
cannot run."""

import os
import subprocess

from harness.warm_exec import WarmExecutable

SCRIPT = """import os, sys
print("argv", sys.argv[1:], "cwd", os.path.basename(os.getcwd()), "X", os.environ.get("X"))
print("err", file=sys.stderr)
for line in sys.stdin:
    print(line.strip().upper(), flush=True)
sys.exit(int(os.environ.get("CODE", "0")))
"""


def test_the_warm_executable_runs_scripts_on_the_callers_streams(tmp_path):
    (tmp_path / "s.py").write_text(SCRIPT)
    with WarmExecutable(dict(os.environ), preload=False) as python:
        env = dict(os.environ, X="1", CODE="3")
        out = subprocess.run([python.path, "-I", "s.py", "a b"], input="hi\nthere\n", capture_output=True,
                             text=True, cwd=tmp_path, env=env, timeout=60)
        assert out.returncode == 3
        assert out.stdout.splitlines() == [f"argv ['a b'] cwd {tmp_path.name} X 1", "HI", "THERE"]
        assert out.stderr == "err\n"
        # two at once, each waiting on its caller: not one after the other
        first, second = (subprocess.Popen([python.path, "s.py"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          text=True, cwd=tmp_path) for _ in range(2))
        for proc, word in ((second, "two"), (first, "one")):
            proc.stdin.write(word + "\n")
            proc.stdin.flush()
            assert proc.stdout.readline().startswith("argv") and proc.stdout.readline() == word.upper() + "\n"
        for proc in (first, second):
            proc.stdin.close()
            assert proc.wait(timeout=60) == 0
        refused = subprocess.run([python.path, "-c", "pass"], capture_output=True, text=True, timeout=60)
        assert refused.returncode == 1
        assert refused.stderr.strip() == ("warm executable: ValueError: runs scripts only, with flags from "
                                          "-IsSEBuOqd; got '-c'")
