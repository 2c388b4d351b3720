"""Head checkpoints: folder and single-file round trips, refusal of foreign/corrupt/truncated files."""

import json

import pytest
import torch

from selfspec.heads.checkpoint import (head_record, head_type, load_head, read_head, read_record, save_head,
                                       save_single_file)
from selfspec.methods.eagle.head import build_eagle
from selfspec.core.errors import UserError
from selfspec.target.model import load_target
from selfspec.heads.vocab import top_tokens
from same_kernels import as_loaded


@pytest.fixture()
def head(target):
    torch.manual_seed(0)
    vocab = top_tokens([(list(range(40)), [1] * 40)], target.identity["vocab_size"], 32)
    return build_eagle(target.model, vocab_size=32, draft_vocab=vocab)


def _same(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("kind", ["folder", "file.pt", "file.safetensors"])
def test_roundtrip(tmp_path, target, head, kind):
    rec = head_record(head, target.identity, metrics={"tau": 1.5})
    path = save_head(head, tmp_path / "head", rec) if kind == "folder" else save_single_file(head, tmp_path / kind, rec)
    loaded = load_head(str(path), target)
    assert _same(loaded, head)
    assert loaded.record["metrics"]["tau"] == 1.5
    assert loaded.draft_vocab.tolist() == head.draft_vocab.tolist()
    x = torch.randn(1, 3, 64)
    with torch.no_grad():  # the same head on the same kernels (tests/same_kernels.py)
        assert torch.equal(loaded.logits(x), as_loaded(head, target).logits(x))


def test_folder_config_describes_the_head(tmp_path, target, head):
    save_head(head, tmp_path / "head", head_record(head, target.identity))
    cfg = json.loads((tmp_path / "head" / "config.json").read_text())
    assert cfg["head"] == {"type": "eagle", "num_layers": 1, "fc_bias": False, "vocab_size": 32, "layer": "llama"}
    assert cfg["target"]["hidden_size"] == 64 and cfg["format_version"] == 2 and cfg["weights_sha256"]


def test_head_for_another_target_is_refused(tmp_path, target, head):
    save_head(head, tmp_path / "head", head_record(head, target.identity))
    other = load_target("tiny:qwen2")
    with pytest.raises(UserError, match="tiny:llama.*tiny:qwen2"):
        load_head(str(tmp_path / "head"), other)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "missing"])
def test_corrupt_checkpoints_are_one_line_errors(tmp_path, target, head, damage):
    path = save_single_file(head, tmp_path / "ckpt.safetensors", head_record(head, target.identity))
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif damage == "garbage":
        path.write_bytes(b"\x00not a checkpoint" * 100)
    else:
        path.unlink()
    with pytest.raises(UserError) as e:
        load_head(str(path), target)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kind", ["folder", "file.pt", "file.safetensors"])
def test_record_is_read_without_the_weights(tmp_path, target, head, kind, monkeypatch):
    from selfspec.heads import checkpoint

    rec = head_record(head, target.identity, training={"steps": 3})
    path = save_head(head, tmp_path / "head", rec) if kind == "folder" else save_single_file(head, tmp_path / kind, rec)
    whole = read_head(str(path))[0]

    def no_weights(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(checkpoint, "load_file", no_weights)
    assert read_record(str(path)) == whole and whole["training"] == {"steps": 3}
    assert head_type(str(path)) == "eagle"


@pytest.mark.parametrize("kind", ["folder", "file.safetensors"])
def test_record_reader_refuses_truncated_weights_in_one_line(tmp_path, target, head, kind):
    rec = head_record(head, target.identity)
    path = save_head(head, tmp_path / "head", rec) if kind == "folder" else save_single_file(head, tmp_path / kind, rec)
    weights = path / "model.safetensors" if kind == "folder" else path
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(UserError, match="corrupt or truncated") as e:
        read_record(str(path))
    assert "\n" not in str(e.value)


def test_foreign_safetensors_is_refused(tmp_path, target):
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(tmp_path / "x.safetensors"))
    with pytest.raises(UserError, match="without a selfspec head config"):
        load_head(str(tmp_path / "x.safetensors"), target)


def test_save_is_atomic_and_keeps_old_head_on_failure(tmp_path, target, head, monkeypatch):
    folder = save_head(head, tmp_path / "head", head_record(head, target.identity))
    before = (folder / "model.safetensors").read_bytes()

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("safetensors.torch.save_file", boom)  # core/atomic.save_tensors writes through it
    with pytest.raises(OSError):
        save_head(head, folder, head_record(head, target.identity))
    assert (folder / "model.safetensors").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["head"]  # no temp folder left behind
