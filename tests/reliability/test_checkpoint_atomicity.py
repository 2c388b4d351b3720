"""Resumable checkpoints (train/state.py) survive a kill at any instruction: a `step_*` folder is either complete
or absent. Kills are simulated in-process by making the deletion the code does fail half-way (as SIGKILL
would stop it); the subprocess kill-and-resume test is test_kill_resume.py."""

from __future__ import annotations

import shutil

import pytest
import torch

from selfspec.train import state


def _save(out, step, keep=2):
    head = {"w": torch.full((4,), float(step))}
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return state.save_state(out, step, head, opt.state_dict(), sched.state_dict(), {"epoch": 0, "batch": step},
                            keep=keep)


class Killed(BaseException):
    """Stands for SIGKILL: nothing after it runs (BaseException, so no `except Exception` swallows it)."""


def _rmtree_killed_midway(path, *args, **kwargs):
    """Delete one file of the folder, then 'die'."""
    files = sorted(p for p in path.rglob("*") if p.is_file())
    if files:
        files[0].unlink()
    raise Killed()


def _all_checkpoints_load(out):
    found = state.list_checkpoints(out)
    for folder in found:
        state.load_state(folder)  # raises a UserError for a half-written or half-deleted checkpoint
    return found


def test_kill_while_pruning_an_old_checkpoint(tmp_path, monkeypatch):
    for step in (1, 2):
        _save(tmp_path, step)
    monkeypatch.setattr(state.shutil, "rmtree", _rmtree_killed_midway)
    with pytest.raises(Killed):
        _save(tmp_path, 3)  # written, then step 1 is pruned... and the process dies mid-delete
    monkeypatch.setattr(state.shutil, "rmtree", shutil.rmtree)
    found = _all_checkpoints_load(tmp_path)
    assert found[-1].name == "step_00000003"


def test_kill_while_rewriting_the_same_step(tmp_path, monkeypatch):
    """The end of training saves the last step a second time (it was also a save_every step)."""
    _save(tmp_path, 4)
    monkeypatch.setattr(state.shutil, "rmtree", _rmtree_killed_midway)
    with pytest.raises(Killed):
        _save(tmp_path, 4)
    monkeypatch.setattr(state.shutil, "rmtree", shutil.rmtree)
    found = _all_checkpoints_load(tmp_path)
    assert found and found[-1].name == "step_00000004"


def test_leftovers_of_killed_saves_are_cleaned_by_the_next_save(tmp_path):
    _save(tmp_path, 1)
    root = state.checkpoint_dir(tmp_path)
    for name in (".tmp-abc", ".old-step_00000001-9", ".trash-step_00000000-9"):  # what kills leave behind
        (root / name).mkdir()
        (root / name / "head.safetensors").write_bytes(b"partial")
    _save(tmp_path, 2)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001", "step_00000002"]
