"""The EAGLE heads' `layer` option (heads/layers.py LAYERS): the Llama layer sized from the target, the same head as
the family's own for a Llama target, records without the key read as `target`, bad values and init copies that
would change meaning refused in one line."""

import pytest
import torch

from selfspec.core.errors import UserError
from selfspec.target.model import load_target
from selfspec.heads.checkpoint import build_head, head_record
from selfspec.heads.layers import llama_layers_config
from selfspec.methods.eagle.head import build_eagle
from selfspec.methods.eagle3.head import build_eagle3
from tolerance import assert_close


def _out(head, width):
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        return head(torch.randn(1, 6, width, generator=g), torch.randint(0, 256, (1, 6), generator=g),
                    torch.arange(6)[None])


@pytest.mark.parametrize("family", ["llama", "llama3"])
def test_for_a_llama_target_both_kinds_are_the_same_head(family):
    target = load_target(f"tiny:{family}")
    for build, width in ((build_eagle, 64), (lambda m, **kw: build_eagle3(m, vocab_size=None, **kw), 192)):
        torch.manual_seed(0)
        llama, own = build(target.model, layer="llama"), build(target.model, layer="target")
        assert llama.state_dict().keys() == own.state_dict().keys()
        own.load_state_dict(llama.state_dict())
        assert torch.equal(_out(llama, width), _out(own, width))


def test_the_llama_config_is_sized_from_the_target():
    gemma = load_target("tiny:gemma3").config
    cfg = llama_layers_config(gemma, 2)
    assert (cfg.model_type, cfg.hidden_act, cfg.head_dim, cfg.num_key_value_heads, cfg.num_hidden_layers) == \
        ("llama", "silu", 16, 2, 2)
    assert cfg.rope_parameters["rope_theta"] == 1e6  # the global layers' (a head attends to the whole context)
    assert not cfg.attention_bias and not cfg.mlp_bias and not cfg.tie_word_embeddings and cfg.vocab_size == 1
    assert llama_layers_config(load_target("tiny:gpt_oss").config, 1).rope_parameters["rope_type"] == "yarn"


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_a_record_without_layer_builds_the_family_layer(family):
    """Every head saved before the option (the shipped ones included) holds the family's own layer."""
    target = load_target(f"tiny:{family}")
    for head in (build_eagle(target.model, layer="target"), build_eagle3(target.model, layer="target")):
        cfg = head_record(head, target.identity)["head"]
        assert cfg.pop("layer") == "target"
        loaded = build_head(cfg, head.state_dict(), target, "old head")
        assert loaded.layer == "target" and loaded.config.model_type == head.config.model_type != "llama"


def test_a_bad_layer_is_one_line_with_the_choices():
    target = load_target("tiny:llama")
    for build in (build_eagle, build_eagle3):
        with pytest.raises(UserError, match=r"layer='qwen'.*llama, target") as e:
            build(target.model, layer="qwen")
        assert "\n" not in str(e.value)


def test_init_from_layer_into_a_llama_layer():
    """A Mistral layer is a Llama layer: the copy computes what the family-layer head's copy does. A Qwen3 layer
    is not (q/k norms): refused rather than copied in part."""
    mistral = load_target("tiny:mistral")
    torch.manual_seed(0)
    llama = build_eagle(mistral.model, init_from_layer=1, layer="llama")
    own = build_eagle(mistral.model, init_from_layer=1, layer="target")
    own.fc.load_state_dict(llama.fc.state_dict())
    assert torch.equal(_out(llama, 64), _out(own, 64))
    with pytest.raises(UserError, match="'qwen3' layer.*draft.layer=target"):
        build_eagle(load_target("tiny:qwen3").model, init_from_layer=1)


def test_eagle3_norm_starts_as_the_targets_whatever_its_form():
    """Gemma's norm scales by (1 + w), Llama's by w: the head's final norm computes the target's."""
    target = load_target("tiny:gemma3", seed=5)  # its own copy: its norm is changed here
    with torch.no_grad():
        target.model.model.norm.weight.normal_()
        head = build_eagle3(target.model)
        x = torch.randn(3, 64)
        assert_close(head.norm(x), target.model.model.norm(x), k=64)  # one mean square over H
