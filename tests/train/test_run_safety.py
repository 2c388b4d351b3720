"""One output_dir holds one run (train/loop.py): resume values, run identity, the writer lock, pruning of only
this run's checkpoints, every rank's RNG and the GradScaler in checkpoints, and a non-finite loss that stops the
run before anything broken is saved or exported."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from harness.two_ranks import free_port, head_digests, real_launch
from selfspec.train import state
from selfspec.methods.eagle.train import main

ROOT = Path(__file__).resolve().parents[2]
TINY = ["target=tiny-llama", "data=tiny", "data.max_conversations=24", "train.eval_every=0", "train.eval_prompts=0",
        "train.log_every=1"]


def _refused(capsys, args) -> str:
    """Run the recipe expecting a user error: -> its one line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()  # a progress bar (tqdm writes to stderr) may come first
    assert [line for line in err if line.startswith("error: ")] == err[-1:], err
    return err[-1]


def _steps(out: Path) -> list[int]:
    return [int(p.name.split("_")[1]) for p in state.list_checkpoints(out)]


def test_unknown_resume_value_is_refused_in_one_line(tmp_path, capsys):
    line = _refused(capsys, TINY + ["train.max_steps=1", "resume=sometimes", f"output_dir={tmp_path / 'run'}"])
    assert "resume='sometimes'" in line and "auto" in line and "never" in line


def test_resume_never_refuses_a_run_and_overwrite_replaces_it(tmp_path, capsys):
    out = tmp_path / "run"
    main(TINY + ["train.max_steps=4", "train.save_every=2", "train.keep_last=1", f"output_dir={out}"])
    assert _steps(out) == [4] and (out / "run.json").exists() and (out / "config.yaml").exists()
    line = _refused(capsys, TINY + ["train.max_steps=2", "resume=never", f"output_dir={out}"])
    assert "holds a run (checkpoints up to step 4)" in line and "overwrite=true" in line
    assert _steps(out) == [4]  # refused before anything was written
    main(TINY + ["train.max_steps=2", "train.save_every=1", "train.keep_last=1", "resume=never", "overwrite=true",
                 f"output_dir={out}"])
    assert "overwrite=true: removed the run" in capsys.readouterr().out
    assert _steps(out) == [2]  # the new run's own checkpoints survive; the old run's are gone
    assert json.loads((out / "run.json").read_text())["identity"]["train.max_steps"] == 2


def test_resume_auto_refuses_another_run_naming_the_first_differing_key(tmp_path, capsys):
    out = tmp_path / "run"
    main(TINY + ["train.max_steps=4", "train.lr=3e-4", f"output_dir={out}"])
    files = ("head/model.safetensors", "run.json", "config.yaml", "checkpoints/step_00000004/head.safetensors")
    before = {f: (out / f).read_bytes() for f in files}
    line = _refused(capsys, TINY + ["train.max_steps=4", "train.lr=1e-3", f"output_dir={out}"])
    assert f"output_dir '{out}' holds another run (train.lr=0.0003 there, train.lr=0.001 here)" in line
    assert "overwrite=true" in line and {f: (out / f).read_bytes() for f in files} == before  # untouched
    # logging/eval/save/budget keys are not the run's identity: the same run continues (it is complete here)
    main(TINY + ["train.max_steps=4", "train.lr=3e-4", "train.log_every=2", "train.max_minutes=5", f"output_dir={out}"])
    assert "the run is complete" in capsys.readouterr().out


def test_a_checkpoint_past_this_runs_length_is_refused(tmp_path, capsys):
    """A checkpoint with no run identity (an older selfspec) that went further than this run: no step would run
    and its head would be exported under this run's record."""
    out = tmp_path / "run"
    main(TINY + ["train.max_steps=4", f"output_dir={out}"])
    (out / "run.json").unlink(missing_ok=True)
    position = out / "checkpoints" / "step_00000004" / "position.json"
    position.write_text(json.dumps({k: v for k, v in json.loads(position.read_text()).items() if k != "run"}))
    line = _refused(capsys, TINY + ["train.max_steps=2", f"output_dir={out}"])
    assert "is at step 4, past this run's last step (2)" in line


def test_pruning_keeps_other_runs_checkpoints_and_orders_by_step_number(tmp_path):
    def save(step, run):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        state.save_state(tmp_path, step, {"w": torch.zeros(2)}, opt.state_dict(), sched.state_dict(),
                         {"epoch": 0, "batch": step, "run": run}, keep=2)

    save(100, {"id": "old"})
    for step in (1, 2, 3):
        save(step, {"id": "new"})
    assert _steps(tmp_path) == [2, 3, 100]
    (state.checkpoint_dir(tmp_path) / "step_100000000").mkdir()  # 9 digits: sorts before step_99999999 by name
    (state.checkpoint_dir(tmp_path) / "step_99999999").mkdir()
    assert _steps(tmp_path)[-2:] == [99999999, 100000000]


def test_a_second_run_on_a_locked_output_dir_is_refused(tmp_path, capsys):
    from selfspec.core.atomic import acquire_lock

    out = tmp_path / "run"
    lock = acquire_lock(out)  # another run holds the folder
    try:
        line = _refused(capsys, TINY + ["train.max_steps=1", f"output_dir={out}"])
    finally:
        lock.release()
    assert "is in use by another selfspec run" in line and not (out / "checkpoints").exists()


def test_a_killed_run_leaves_no_stale_lock(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "methods/eagle/train.py", *TINY, "train.max_steps=100000",
                             f"output_dir={out}"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    lock_file, holder = out / ".selfspec.lock", f"pid {proc.pid}"
    try:
        deadline = time.time() + 120
        while proc.poll() is None and time.time() < deadline:
            if lock_file.exists() and lock_file.read_text() == holder:  # it holds output_dir's lock
                break
            time.sleep(0.1)
        assert lock_file.read_text() == holder
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    from selfspec.core.atomic import acquire_lock

    acquire_lock(out).release()


def test_a_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    # lr 1e30, no warm-up: step 1 moves every weight to ~1e30 (finite); step 2's forward overflows to nan
    line = _refused(capsys, TINY + ["train.max_steps=6", "train.save_every=1", "train.lr=1e30", "train.warmup_steps=0",
                                    f"output_dir={out}"])
    m = re.fullmatch(r"error: non-finite (loss \((nan|inf)\)|head weights) at step (\d+); the last good checkpoint "
                     r"is (\S+); .*", line)
    assert m, line
    assert not (out / "head").exists() and not (out / "ckpt.pt").exists()
    assert _steps(out) and Path(m.group(4)) == state.list_checkpoints(out)[-1]
    assert _steps(out)[-1] < int(m.group(3))
    for folder in state.list_checkpoints(out):
        assert all(torch.isfinite(v).all() for v in load_file(str(folder / "head.safetensors")).values())


def test_the_grad_scaler_is_saved_and_restored(tmp_path):
    from accelerate import Accelerator

    from selfspec.train.config import TrainConfig
    from selfspec.train.loop import restore, save, start_run
    from selfspec.train.run import Resumed

    def run_with_scaler(scale):
        acc = Accelerator(cpu=True)
        acc.scaler = torch.amp.GradScaler("cpu", init_scale=scale)
        head = torch.nn.Linear(2, 2)
        return start_run(acc, head, list(head.parameters()), TrainConfig(max_steps=3, warmup_steps=0), 4, tmp_path,
                         position={})

    run = run_with_scaler(512.0)
    run.step = 1
    save(run)
    folder = state.latest_checkpoint(tmp_path)
    resumed = Resumed(folder, *state.load_state(folder))
    assert resumed.trainer["scaler"]["scale"] == 512.0 and set(resumed.trainer["rng"]) == {"cpu_0"}
    other = run_with_scaler(1.0)
    restore(other, resumed)
    assert other.accelerator.scaler.get_scale() == 512.0


def test_two_processes_save_each_ranks_rng_and_refuse_a_locked_output_dir(tmp_path, launch2):
    """Two CPU processes: every rank's RNG state is in the checkpoint, a resumed launch ends with the same weights
    as an uninterrupted one (accelerate's launcher, tests/train/conftest.py), and a locked output_dir stops both
    ranks of a real `accelerate launch` at once."""
    from selfspec.core.atomic import acquire_lock

    def entry(out):
        return ["methods/eagle/train.py", *TINY, "train.max_steps=4", "train.save_every=2", "train.keep_last=0",
                f"output_dir={out}"]

    full, part = tmp_path / "full", tmp_path / "part"
    run = launch2(entry(full), ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    rng = load_file(str(full / "checkpoints" / "step_00000002" / "rng.safetensors"))
    assert set(rng) == {"cpu_0", "cpu_1"}
    (part / "checkpoints").mkdir(parents=True)
    os.system(f"cp -r {full}/checkpoints/step_00000002 {part}/checkpoints/")
    resumed = launch2(entry(part), ROOT)
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr[-2000:]
    assert len(head_digests(run)) == 1 and head_digests(run) == head_digests(resumed)

    lock = acquire_lock(part)
    try:
        refused = real_launch(entry(part), ROOT, timeout=300)
    finally:
        lock.release()
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error: ")]
    assert refused.returncode != 0 and errors and all("in use by another selfspec run" in e for e in errors)


def test_fsdp_state_is_gathered_whole_and_loaded_back(tmp_path):
    """FSDP2 (fully_shard) on two CPU processes with gloo: see _fsdp_worker.py."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(Path(__file__).with_name("_fsdp_worker.py")), str(tmp_path / "run")]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "fsdp state round trip ok" in run.stdout, run.stderr[-3000:]


def _saved_checkpoint(tmp_path) -> Path:
    head = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(head.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return state.save_state(tmp_path, 1, head.state_dict(), opt.state_dict(), sched.state_dict(),
                            {"epoch": 0, "batch": 1})


def test_a_permission_error_is_not_called_damage(tmp_path, monkeypatch):
    folder = _saved_checkpoint(tmp_path)

    def denied(*a, **k):
        raise PermissionError(13, "Permission denied", str(folder / "head.safetensors"))

    monkeypatch.setattr(state, "load_file", denied)
    with pytest.raises(state.UserError) as e:
        state.load_state(folder)
    assert "permission denied" in str(e.value) and "delete" not in str(e.value)


def test_memory_error_passes_through_as_itself(tmp_path, monkeypatch):
    folder = _saved_checkpoint(tmp_path)

    def oom(*a, **k):
        raise MemoryError

    monkeypatch.setattr(state, "load_file", oom)
    with pytest.raises(MemoryError):
        state.load_state(folder)
