"""Head folders and files are written so that no crash loses a head: there is always a complete `head/` (the old or
the new), leftovers of killed writes are cleaned by the next write, a folder a crash left renamed away is put back
when read, and renames are made durable (the directory is fsynced)."""

import os
import stat

import pytest
import torch

from selfspec.core import atomic
from selfspec.heads.checkpoint import head_record, read_head, save_head, save_single_file
from selfspec.methods.eagle.head import build_eagle


def _head(target, seed):
    torch.manual_seed(seed)
    return build_eagle(target.model)


def _weight(spec):
    return read_head(str(spec))[1]["fc.weight"]


class Killed(BaseException):
    """Stands for SIGKILL: nothing after it runs."""


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_kill_between_the_renames_never_leaves_no_head(tmp_path, target, monkeypatch, exchange):
    """Die at each rename of a save over an existing head: a reader then finds the old head or the new one
    (with one atomic exchange, or where that is missing with two renames and a recovery on read)."""
    if not exchange:
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    old, new = _head(target, 0), _head(target, 1)
    for die_at in range(1, 4):
        folder = save_head(old, tmp_path / f"run{die_at}" / "head", head_record(old, target.identity))
        real, calls = os.replace, []

        def replace(a, b, *args, **kw):
            calls.append(b)
            if len(calls) == die_at:
                raise Killed()
            return real(a, b, *args, **kw)

        monkeypatch.setattr(os, "replace", replace)
        try:
            save_head(new, folder, head_record(new, target.identity))
        except Killed:
            pass
        monkeypatch.setattr(os, "replace", real)
        w = _weight(folder)  # no "not found": the old head (or the new one) is there
        assert torch.equal(w, old.fc.weight) or torch.equal(w, new.fc.weight)


def test_reader_puts_back_a_head_a_crash_left_renamed_away(tmp_path, target):
    head = _head(target, 0)
    folder = save_head(head, tmp_path / "head", head_record(head, target.identity))
    folder.rename(tmp_path / f".head{atomic.OLD}4242")  # what a kill between the two renames leaves
    assert torch.equal(_weight(folder), head.fc.weight)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head"]


def test_leftovers_of_killed_saves_are_cleaned_by_the_next_save(tmp_path, target):
    head = _head(target, 0)
    folder = save_head(head, tmp_path / "head", head_record(head, target.identity))
    for name in (f".head{atomic.TMP}abcd_123", f".head{atomic.OLD}99"):  # mkdtemp's 8 characters; a pid
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"partial")
    (tmp_path / f".head.pt{atomic.TMP}x").write_bytes(b"partial")  # someone else's name: kept
    (tmp_path / "headroom").mkdir()  # a sibling that merely starts alike: kept
    save_head(head, folder, head_record(head, target.identity))
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".head.pt{atomic.TMP}x", "head", "headroom"]


def _dir_fsyncs(monkeypatch):
    seen = []
    real = os.fsync

    def fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            seen.append(fd)
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return seen


def test_save_head_fsyncs_files_and_the_folder(tmp_path, target, monkeypatch):
    seen = _dir_fsyncs(monkeypatch)
    head = _head(target, 0)
    save_head(head, tmp_path / "head", head_record(head, target.identity))
    assert seen, "no directory was fsynced after the rename"


@pytest.mark.parametrize("name", ["head.safetensors", "head.pt"])
def test_single_file_export_is_atomic_and_durable(tmp_path, target, monkeypatch, name):
    head, other = _head(target, 0), _head(target, 1)
    path = save_single_file(head, tmp_path / name, head_record(head, target.identity))
    before = path.read_bytes()
    seen = _dir_fsyncs(monkeypatch)
    monkeypatch.setattr("safetensors.torch.save_file",
                        lambda *a, **k: (_ for _ in ()).throw(OSError(28, "full")))
    monkeypatch.setattr("selfspec.heads.checkpoint.torch.save",
                        lambda *a, **k: (_ for _ in ()).throw(OSError(28, "full")))
    with pytest.raises(OSError):
        save_single_file(other, path, head_record(other, target.identity))
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == [name]
    monkeypatch.undo()
    seen = _dir_fsyncs(monkeypatch)
    save_single_file(other, path, head_record(other, target.identity))
    assert torch.equal(_weight(path), other.fc.weight)
    assert seen, "no directory was fsynced after the rename"


def test_written_heads_are_as_readable_as_any_file(tmp_path, target):
    """Temp files and folders are private (0600/0700); what is renamed into place gets the usual mode, so a head
    or a cache on a shared disk stays readable by the others who could read a plain file there."""
    umask = os.umask(0o022)
    try:
        head = _head(target, 0)
        folder = save_head(head, tmp_path / "head", head_record(head, target.identity))
        path = save_single_file(head, tmp_path / "head.safetensors", head_record(head, target.identity))
    finally:
        os.umask(umask)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
