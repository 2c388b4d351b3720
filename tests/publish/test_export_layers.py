"""Engine-layer drafts (heads/layers.py `layer`): a layer=llama head of any family exports in every EAGLE layout as
the Llama layer it is, and reads back (publish/importer.py) with the same outputs; a layer=target head of a
non-Llama family is refused with what the engine lacks; a Llama target's exports do not depend on the kind."""

import pytest
import torch
from safetensors.torch import load_file

from selfspec.core.errors import UserError
from selfspec.target.model import load_target
from selfspec.heads.checkpoint import head_record
from selfspec.methods.eagle.head import build_eagle
from selfspec.methods.eagle3.head import build_eagle3
from selfspec.publish.export import convert, to_gguf, write_export
from selfspec.publish.importer import imported_head
from same_kernels import as_loaded

FAMILIES = ["qwen3", "qwen2", "gemma3", "mistral"]
EAGLE1 = ["eagle", "speculators", "sglang"]
EAGLE3 = ["speculators", "sglang"]
LLAMA_ROPE_THETA = {"qwen3": 10000.0, "qwen2": 10000.0, "gemma3": 1000000.0, "mistral": 10000.0}  # gemma3: global


def _target(family):
    return load_target(f"tiny:{family}", tiny={"num_hidden_layers": 4})  # EAGLE-3 reads 3 distinct layers


def _outputs(head, target):
    as_loaded(head, target)
    g = torch.Generator().manual_seed(3)
    feats = torch.randn(1, 5, head.fc.in_features if head.head_type == "eagle3" else 64, generator=g)
    ids = torch.randint(0, 256, (1, 5), generator=g)
    with torch.no_grad():
        out = head(feats, ids, torch.arange(5)[None])
        return torch.cat([out.flatten(), head.logits(out).flatten()])


def _heads(target, layer="llama"):
    torch.manual_seed(0)
    return {"eagle": build_eagle(target.model, layer=layer),
            "eagle3": build_eagle3(target.model, aux_layers=[1, 2, 3], vocab_size=None, layer=layer)}


def _export(head, target, fmt, out):
    record = head_record(head, target.identity)
    state = {k: v.detach().clone() for k, v in head.state_dict().items()}
    export = convert(record, state, target.config, fmt)
    write_export(export, record, out)
    return export


@pytest.mark.parametrize("family", FAMILIES)
def test_a_llama_layer_head_of_any_family_exports_and_reads_back(tmp_path, family):
    target = _target(family)
    for kind, head in _heads(target).items():
        for fmt in EAGLE1 if kind == "eagle" else EAGLE3:
            export = _export(head, target, fmt, tmp_path / f"{kind}-{fmt}")
            layer = export.config.get("transformer_layer_config", export.config)
            assert layer["model_type"] == "llama" and layer["hidden_act"] == "silu", (kind, fmt)
            assert layer["head_dim"] == 16 and layer["rope_theta"] == LLAMA_ROPE_THETA[family]
            assert not any("norm" in k and ("q_" in k or "k_" in k) for k in export.tensors), (kind, fmt)
            back = imported_head(tmp_path / f"{kind}-{fmt}", target)
            assert back.layer == "llama"
            assert torch.equal(_outputs(back, target), _outputs(head, target)), (family, kind, fmt)
    head = _heads(target)["eagle3"]  # llama.cpp: the Llama layer's RoPE (Gemma 3: its global layers')
    gguf = to_gguf(head_record(head, target.identity), {k: v.detach() for k, v in head.state_dict().items()},
                   target.config)
    assert {k: v for k, v, _, _ in gguf.kv}["eagle3.rope.freq_base"] == LLAMA_ROPE_THETA[family]


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_a_family_layer_head_is_refused_with_what_the_engine_lacks(family):
    target = _target(family)
    for kind, head in _heads(target, layer="target").items():
        record = head_record(head, target.identity)
        state = {k: v.detach() for k, v in head.state_dict().items()}
        for fmt in [*(EAGLE1 if kind == "eagle" else EAGLE3), *(["gguf"] if kind == "eagle3" else [])]:
            with pytest.raises(UserError) as e:
                to_gguf(record, state, target.config) if fmt == "gguf" else convert(record, state, target.config, fmt)
            msg = str(e.value)
            assert "draft.layer=llama" in msg and "q_norm.weight" in msg and "\n" not in msg, (kind, fmt, msg)


@pytest.mark.parametrize("family", ["llama", "llama3"])
def test_a_llama_targets_exports_are_the_same_for_both_kinds(tmp_path, family):
    target = load_target(f"tiny:{family}", tiny={"num_hidden_layers": 4})
    llama, own = _heads(target, "llama"), _heads(target, "target")
    for kind in ("eagle", "eagle3"):
        own[kind].load_state_dict(llama[kind].state_dict())
        for fmt in EAGLE1 if kind == "eagle" else EAGLE3:
            a = _export(llama[kind], target, fmt, tmp_path / f"a-{kind}-{fmt}")
            b = _export(own[kind], target, fmt, tmp_path / f"b-{kind}-{fmt}")
            assert a.config == b.config, (kind, fmt)
            assert (tmp_path / f"a-{kind}-{fmt}" / "config.json").read_bytes() == \
                (tmp_path / f"b-{kind}-{fmt}" / "config.json").read_bytes()
            ta, tb = load_file(tmp_path / f"a-{kind}-{fmt}" / "model.safetensors"), \
                load_file(tmp_path / f"b-{kind}-{fmt}" / "model.safetensors")
            assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
