"""Issue 47's data losses that exited 0 without a word: a user's file in a run's head/ deleted when the run is
extended or replaced; lines appended to a generate output_file dropped by a rerun or by a concurrent write; an `out=`
that is a symlink to the user's folder renamed away; and a Ctrl-C after the work was done ending in a traceback from an
exit handler or a silent death by SIGINT. Tiny targets, in-process where possible: seconds per test."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from entry_points import digest, refused, run

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ["target=tiny-llama", "data=tiny", "logger=none", "data.max_conversations=4", "train.eval_every=0",
         "train.eval_prompts=0"]


# ---------------------------------------------------------------------------------------------- head/ of a run


def test_extending_or_replacing_a_run_keeps_the_users_files_in_its_head(tmp_path):
    from selfspec.methods.eagle.train import main

    out = tmp_path / "r"
    assert run(main, *TRAIN, "train.max_steps=1", f"output_dir={out}") == 0
    (out / "head" / "NOTES.md").write_text("notes\n")
    (out / "head" / "plots").mkdir()
    (out / "head" / "plots" / "a.png").write_bytes(b"the user's figure")
    for extra in (["train.max_steps=2", "resume=auto"], ["train.max_steps=3", "overwrite=true"]):
        weights = digest(out / "head")["model.safetensors"]
        assert run(main, *TRAIN, *extra, f"output_dir={out}") == 0
        assert digest(out / "head")["model.safetensors"] != weights, extra  # the head itself was rewritten
        assert (out / "head" / "NOTES.md").read_text() == "notes\n", extra
        assert (out / "head" / "plots" / "a.png").read_bytes() == b"the user's figure", extra
        assert not [p.name for p in out.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_replacing_a_run_removes_its_checkpoints_not_the_users_files_beside_them(tmp_path):
    """overwrite=true removes the old run's step_<N> checkpoints; a file the user put in checkpoints/ stays."""
    from selfspec.methods.eagle.train import main

    out = tmp_path / "r"
    assert run(main, *TRAIN, "train.max_steps=2", "train.save_every=1", f"output_dir={out}") == 0
    (out / "checkpoints" / "WHICH_ONE.md").write_text("step 2 was the good one\n")
    old = {p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step_")}
    assert old and run(main, *TRAIN, "train.max_steps=1", "overwrite=true", f"output_dir={out}") == 0
    assert (out / "checkpoints" / "WHICH_ONE.md").read_text() == "step 2 was the good one\n"
    assert {p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step_")} == {"step_00000001"}
    assert not [p.name for p in out.iterdir() if p.name.startswith(".trash-")]


# ---------------------------------------------------------------------------------------------- generate output_file

GENERATE = ["target=tiny-llama", "drafter=none", "max_new_tokens=1", "prompt=hi"]


def test_a_rerun_of_generate_never_drops_lines_the_user_added(tmp_path, capsys):
    from selfspec.decode.generate import main

    out = tmp_path / "h.jsonl"
    assert run(main, *GENERATE, f"output_file={out}") == 0
    for line in ('{"prompt": "mine", "note": "kept by hand"}\n', "a line of my own\n"):
        mine = out.read_text() + line
        out.write_text(mine)
        assert run(main, *GENERATE, f"output_file={out}") == 2
        refused(capsys, "output_file", "overwrite=true")
        assert out.read_text() == mine
    assert run(main, *GENERATE, f"output_file={out}", "overwrite=true") == 0  # the user said so
    assert [json.loads(line)["prompt"] for line in out.read_text().splitlines()] == ["hi"]


def test_a_line_appended_while_generate_runs_is_never_lost(tmp_path, monkeypatch, capsys):
    import selfspec.decode.generate as gen

    out = tmp_path / "h.jsonl"
    assert run(gen.main, *GENERATE, f"output_file={out}") == 0
    real = gen.generate

    def with_an_appender(*args, **kwargs):  # another process appends to output_file while this one decodes
        with open(out, "a") as f:
            f.write('{"prompt": "hi", "completion": "appended meanwhile"}\n')
        return real(*args, **kwargs)

    monkeypatch.setattr(gen, "generate", with_an_appender)
    assert run(gen.main, *GENERATE, f"output_file={out}") == 2
    refused(capsys, "output_file", "changed")
    assert out.read_text().splitlines()[-1] == '{"prompt": "hi", "completion": "appended meanwhile"}'
    assert not [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name or p.name.endswith(".lock")]


# ---------------------------------------------------------------------------------------------- out= a symlink


@pytest.fixture(scope="module")
def export_src(tmp_path_factory, head_dir):
    from selfspec.scripts.export import main

    out = tmp_path_factory.mktemp("exports") / "exp"
    assert run(main, f"head={head_dir}", "format=eagle", f"out={out}") == 0
    return out


@pytest.mark.parametrize("which", ["export", "import-head"])
def test_out_a_symlink_to_a_users_folder_is_written_through_never_renamed(tmp_path, head_dir, export_src, which,
                                                                          capsys):
    from selfspec.scripts import export, import_head

    main, args, record = {"export": (export.main, [f"head={head_dir}", "format=eagle"], "selfspec.json"),
                          "import-head": (import_head.main, [f"src={export_src}", "target=tiny-llama"], "config.json")
                          }[which]
    real, lk = tmp_path / "users" / "folder", tmp_path / "lk"
    real.mkdir(parents=True)
    lk.symlink_to(real)
    for again in ([], ["overwrite=true"]):  # into the empty folder, then over its own output there
        assert run(main, *args, f"out={lk}", *again) == 0
        assert lk.is_symlink() and os.readlink(lk) == str(real)
        assert (real / record).is_file()
    (real / "NOTES.md").write_text("mine")
    before = digest(real)
    assert run(main, *args, f"out={lk}", "overwrite=true") == 2
    refused(capsys, "NOTES.md")
    assert lk.is_symlink() and digest(real) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lk", "users"]
    assert sorted(p.name for p in real.parent.iterdir()) == ["folder"]


# ---------------------------------------------------------------------------------------------- Ctrl-C after the work

# A Ctrl-C delivered by the process to itself at one moment after `[train] wrote`, the script run as `python
# methods/eagle/train.py` would run it.
PROBE = """
import atexit, os, runpy, signal, sys, types
moment, script = sys.argv[1], sys.argv[2]
hit = lambda *_: os.kill(os.getpid(), signal.SIGINT)
if moment == "closing the run":
    import selfspec.train.loop as loop
    close = loop.close
    loop.close = lambda run: (hit(), close(run))
elif moment == "exit handlers":
    atexit.register(hit)  # registered first: the last exit handler to run
elif moment == "teardown":
    class Teardown:
        def __del__(self):
            hit()
    sys.modules["probe"] = types.ModuleType("probe")
    sys.modules["probe"].probe = Teardown()  # freed when the interpreter frees its modules
sys.argv = [script, *sys.argv[3:]]
runpy.run_path(script, run_name="__main__")
"""


@pytest.mark.parametrize("moment, code", [("closing the run", 130), ("exit handlers", 130), ("teardown", 0)])
def test_a_ctrl_c_after_the_work_is_done_says_so_in_one_line(tmp_path, moment, code):
    out = tmp_path / "r"
    done = subprocess.run([sys.executable, "-c", PROBE, moment, str(ROOT / "methods" / "eagle" / "train.py"), *TRAIN,
                           "train.max_steps=1", f"output_dir={out}"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    err = [line for line in done.stderr.splitlines() if line.strip() and "%|" not in line]
    assert "[train] wrote" in done.stdout
    assert done.returncode == code, (done.returncode, err[-5:])  # never -SIGINT: a silent death mid-teardown
    assert not any("Traceback" in line or "Exception ignored" in line for line in err), err[-8:]
    if code == 130:
        assert err[-1].startswith("error: interrupted") and "complete" in err[-1], err[-1]
    assert (out / "head" / "model.safetensors").is_file() and (out / "ckpt.pt").is_file()
    assert not [p.name for p in out.iterdir() if p.name.endswith(".lock")]
    assert -signal.SIGINT != done.returncode


# ---------------------------------------------------------------------------------------------- red team round 4


def test_an_output_name_as_long_as_its_config_allows_is_written_and_a_longer_one_refused(tmp_path, head_dir, capsys):
    """Our own names beside an output (its lock, its temp file) never overflow the file system's 255 bytes: an
    output_file of 249 characters (its config beside it, <name>.config.yaml, is 255) is written; at 250 its config's
    name could not exist, which is said in one line before anything is done. A folder output (export) of 250."""
    from selfspec.decode.generate import main
    from selfspec.scripts.export import main as export

    out = tmp_path / ("o" * 243 + ".jsonl")
    assert run(main, *GENERATE, f"output_file={out}") == 0
    assert json.loads(out.read_text())["prompt"] == "hi"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([out.name, "o" * 243 + ".config.yaml"])
    longer = tmp_path / ("p" * 244 + ".jsonl")
    assert run(main, *GENERATE, f"output_file={longer}") == 2
    refused(capsys, "config.yaml", "255")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([out.name, "o" * 243 + ".config.yaml"])
    folder = tmp_path / ("e" * 250)
    assert run(export, f"head={head_dir}", "format=eagle", f"out={folder}") == 0
    assert (folder / "selfspec.json").is_file() and len(list(tmp_path.iterdir())) == 3


GENERATE_SLOW = ["target=tiny-llama", "drafter=none", "max_new_tokens=64"]


def _generate_until_its_temp_file(tmp_path: Path, out: Path) -> subprocess.Popen:
    """A generate run over many prompts, returned once its rows are being written to the temp file beside `out`."""
    import time

    prompts = tmp_path / "p.jsonl"  # beside the output's folder, not in it
    prompts.write_text("".join(json.dumps({"prompt": f"count to {i}"}) + "\n" for i in range(200)))
    proc = subprocess.Popen([sys.executable, str(ROOT / "decode" / "generate.py"), *GENERATE_SLOW,
                             f"prompts_file={prompts}", f"output_file={out}"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    deadline = time.time() + 120
    while not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.tmp-") and p.stat().st_size]:
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-1500:]
        time.sleep(0.1)
    return proc


def test_sigterm_during_generate_leaves_nothing_behind(tmp_path):
    """A SIGTERM (a scheduler's stop, `kill`) ends a command as Ctrl-C does: one line, exit 143, its temp file and
    lock removed, the earlier output_file as it was."""
    from selfspec.decode.generate import main

    out = tmp_path / "out" / "o.jsonl"
    assert run(main, *GENERATE, f"output_file={out}") == 0
    before = digest(out.parent)
    proc = _generate_until_its_temp_file(tmp_path, out)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=120)[1]
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 143 and lines[-1] == "error: terminated", (proc.returncode, lines[-3:])
    assert "Traceback" not in err
    assert digest(out.parent) == before  # nothing left: no temp file, no lock; the output as it was


def test_a_later_run_removes_what_a_killed_one_left_and_only_that(tmp_path, capsys):
    """kill -9 leaves a write's temp file and its lock beside the output (nothing can remove them then): the next
    run of that output, which holds its writer lock and so knows no live writer owns them, removes them. A file of
    the user's whose name merely looks alike stays."""
    from selfspec.decode.generate import main

    out = tmp_path / "out" / "o.jsonl"
    out.parent.mkdir()
    proc = _generate_until_its_temp_file(tmp_path, out)
    proc.kill()
    proc.wait(timeout=60)
    left = sorted(p.name for p in out.parent.iterdir())
    assert [n for n in left if ".tmp-" in n] and [n for n in left if n.endswith(".selfspec.lock")], left
    (out.parent / ".o.jsonl.tmp-mine.txt").write_text("the user's\n")
    assert run(main, *GENERATE, f"output_file={out}") == 0
    assert sorted(p.name for p in out.parent.iterdir()) == [".o.jsonl.tmp-mine.txt", "o.config.yaml", "o.jsonl"]


def test_a_lock_that_cannot_be_written_leaves_nothing(tmp_path, monkeypatch):
    """A full disk may leave room for the lock file's inode but not for the pid in it: that write fails, naming the
    lock file, and neither the lock file nor the folders made for it stay."""
    import errno

    from selfspec.core import atomic

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic.os, "pwrite", full)
    with pytest.raises(OSError) as e:
        atomic.lock_beside(tmp_path / "new" / "o.jsonl")
    assert e.value.errno == errno.ENOSPC and e.value.filename.endswith(".o.jsonl.selfspec.lock")
    assert list(tmp_path.iterdir()) == []
