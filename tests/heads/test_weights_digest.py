"""Issue 47: a head records the sha256 of its weights (heads/checkpoint.weights_digest) and loading checks it, so a
flipped bit that every file format reads fine is refused in one line; heads saved before (format 1, no digest) still
load, a later one without its digest does not; a head's files that are not regular files (a FIFO would block the read
forever) are refused before they are opened."""

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from selfspec.core.errors import UserError
from selfspec.heads.checkpoint import (DIGEST_KEY, head_record, load_head, read_record, save_head, save_single_file,
                                       weights_digest)
from selfspec.methods.eagle.head import build_eagle


@pytest.fixture()
def head(target):
    torch.manual_seed(0)
    return build_eagle(target.model)


def _nudged(state: dict) -> dict:
    """One element of fc.weight one float32 step away: still finite, every shape the same."""
    w = state["fc.weight"].clone()
    w.view(-1).view(torch.int32)[7] ^= 1
    return {**state, "fc.weight": w}


def _save(kind, head, target, path):
    record = head_record(head, target.identity)
    return save_head(head, path, record) if kind == "folder" else save_single_file(head, path.with_suffix(kind), record)


def _tamper(kind, path):
    """Change one bit of the weights, keep the record as it was saved."""
    if kind == "folder":
        save_file(_nudged(load_file(str(path / "model.safetensors"))), str(path / "model.safetensors"))
    elif kind == ".pt":
        blob = torch.load(path, weights_only=True)
        torch.save({**blob, "state_dict": _nudged(blob["state_dict"])}, path)
    else:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
        save_file(_nudged(load_file(str(path))), str(path), metadata=meta)


@pytest.mark.parametrize("kind", ["folder", ".pt", ".safetensors"])
def test_a_changed_bit_is_refused_and_the_intact_head_loads(tmp_path, target, head, kind):
    path = _save(kind, head, target, tmp_path / "h")
    assert read_record(str(path))[DIGEST_KEY] == weights_digest(head.state_dict())
    load_head(str(path), target)
    _tamper(kind, path)
    with pytest.raises(UserError, match=f"sha256 its record holds \\({DIGEST_KEY}\\)"):
        load_head(str(path), target)


def test_a_head_saved_without_a_digest_still_loads_and_one_that_lost_it_is_refused(tmp_path, target, head):
    """Heads of format 1, written before heads recorded one (heads/pretrained/ among them), load; a head of a later
    format whose record lost its digest is refused: deleting it must not let a damaged head through."""
    path = save_head(head, tmp_path / "h", head_record(head, target.identity))
    record = json.loads((path / "config.json").read_text())
    del record[DIGEST_KEY]
    (path / "config.json").write_text(json.dumps(record))
    with pytest.raises(UserError, match=f"its record has no {DIGEST_KEY}, which every head of format 2"):
        load_head(str(path), target)
    (path / "config.json").write_text(json.dumps({**record, "format_version": 1}))
    load_head(str(path), target)


def test_a_digest_carried_from_another_head_is_replaced_at_save(tmp_path, target, head):
    """An imported or re-saved head's record may carry its source's digest: the weights saved with it decide."""
    path = save_head(head, tmp_path / "h", head_record(head, target.identity, **{DIGEST_KEY: "0" * 64}))
    assert read_record(str(path))[DIGEST_KEY] == weights_digest(head.state_dict())
    load_head(str(path), target)


@pytest.mark.parametrize("which", ["model.safetensors", "config.json", "single file"])
def test_a_fifo_is_refused_before_it_is_opened(tmp_path, target, head, which):
    if which == "single file":
        path = tmp_path / "h.safetensors"
        os.mkfifo(path)
        name = path.name
    else:
        path = save_head(head, tmp_path / "h", head_record(head, target.identity))
        (path / which).unlink()
        os.mkfifo(path / which)
        name = which
    with pytest.raises(UserError, match=f"'{name}' is not a regular file"):
        read_record(str(path))  # opening a FIFO for reading would wait for a writer forever
