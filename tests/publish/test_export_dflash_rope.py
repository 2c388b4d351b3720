"""format=gguf of DFlash heads for targets whose RoPE is scaled: Llama 3.1's `llama3` and gpt-oss's `yarn` (and a
`linear` one). The head's layers take the target's RoPE (dflash/head.py draft_config), and llama.cpp's dflash draft
ropes with its own file's: the rope.* keys every architecture reads (src/llama-model.cpp load_hparams) and the
rope_freqs tensor src/models/dflash.cpp loads and passes to ggml_rope_ext.

llama.cpp's converter (the head's sglang export, conversion/qwen.py DFlashModel over Qwen3Model) writes the
rope.scaling.* keys for yarn and linear (conversion/base.py set_gguf_parameters), and our file is its file, byte for
byte. For llama3 it writes nothing (only conversion/llama.py LlamaModel generates rope_freqs), so its file of the head
would rope unscaled; ours is its file plus rope_freqs, the bytes the converter writes for the Llama 3.1 target itself.

The converter comparison needs llama.cpp's tree, as tests/publish/test_export_gguf_rope.py finds it (which also says
why the pre-tokenizer lookup is answered); without it those tests skip.
"""

import copy
import math

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from selfspec.core.errors import UserError
from head_exports import rope_cases
from llamacpp_converter import convert_heads, named_like
from selfspec.methods.dflash.head import build_dflash
from selfspec.publish.export import GGUF_TYPES, diff_gguf, to_gguf, write_gguf
from tolerance import relative_bound

# case -> (tiny family, config overrides). llama: default RoPE.
CASES = {"llama3": ("llama3", {}), "gpt_oss": ("gpt_oss", {}),
         "llama_linear": ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4}}),
         "llama": ("llama", {})}
COMPARED = [(c, t) for c in ("llama3", "gpt_oss") for t in GGUF_TYPES] + [("llama_linear", "f32"), ("llama", "f32")]

def _head(target):
    return build_dflash(target.model, block_size=4, num_layers=2, target_layer_ids=[0, 2], mask_token_id=7)


@pytest.fixture(scope="module")
def cases():
    return rope_cases(CASES, _head)


@pytest.fixture(scope="module")
def converted(cases, tmp_path_factory):
    """Every compared (case, outtype) through `convert_hf_to_gguf.py <sglang export> --target-model-dir <target>`,
    and the llama3 target itself (f32) -> {(case, outtype): the converter's file, "llama3-target": the target's}."""
    return convert_heads(cases, COMPARED, tmp_path_factory, "sglang", weights=True, targets=("llama3",))


@pytest.mark.llamacpp
@pytest.mark.parametrize("case,outtype", COMPARED)
def test_gguf_is_the_converters_file_plus_the_rope_freqs_it_omits(tmp_path, cases, converted, case, outtype):
    """yarn, linear, default: the converter's bytes. llama3: diff_gguf finds only our rope_freqs, and without it the
    bytes are the converter's."""
    target, head, record, state = cases[case]
    ref = converted[case, outtype]
    exp = to_gguf(record, state, target.config, outtype)
    diff = diff_gguf(ref, write_gguf(exp, record, tmp_path / "ours.gguf", ref))
    if case == "llama3":
        assert diff == [f"tensor only in {tmp_path / 'ours.gguf'}: rope_freqs.weight"]
        del exp.tensors["rope_freqs.weight"]
    else:
        assert diff == []
    assert write_gguf(named_like(exp, ref), record, tmp_path / "named.gguf", ref).read_bytes() == ref.read_bytes()


@pytest.mark.llamacpp
def test_rope_freqs_are_the_ones_the_converter_writes_for_the_llama3_target(cases, converted):
    """The head's rope_freqs are, to the byte, the target GGUF's (conversion/llama.py generate_extra_tensors), which
    llama.cpp applies to the Llama 3.1 target's own attention."""
    target, head, record, state = cases["llama3"]
    ours, _ = to_gguf(record, state, target.config).tensors["rope_freqs.weight"]
    theirs = next(t for t in GGUFReader(str(converted["llama3-target"])).tensors if t.name == "rope_freqs.weight")
    assert np.asarray(theirs.data).tobytes() == ours.tobytes()


def _kv(exp):
    return {k: v for k, v, _, _ in exp.kv}


def test_rope_freqs_are_the_llama3_rope_the_head_trained_with(cases):
    """ggml divides frequency i (the NeoX pair i, i + d/2, as rotate_half's) by rope_freqs[i]: so rope_freqs =
    default inv_freq / the head's own llama3 inv_freq."""
    target, head, record, state = cases["llama3"]
    exp = to_gguf(record, state, target.config)
    freqs, qtype = exp.tensors["rope_freqs.weight"]
    assert qtype == "F32" and freqs.dtype == np.float32 and list(exp.tensors)[0] == "rope_freqs.weight"
    assert freqs.shape == (head.config.head_dim // 2,)
    default, _ = Qwen3RotaryEmbedding.compute_default_rope_parameters(head.config)
    llama3, scale = ROPE_INIT_FUNCTIONS["llama3"](head.config, None)
    assert scale == 1.0 and torch.equal(head.rotary_emb.inv_freq, llama3)
    # elementwise fp32 formulas, no reduction: ~24 roundings between the converter's (11) and transformers' (12) and
    # the division (tests/tolerance.py)
    assert torch.allclose(torch.from_numpy(freqs), default / llama3, rtol=relative_bound(torch.float32, 1, 24), atol=0)
    assert {1.0, 8.0} < set(freqs.tolist())  # the high and the low band
    assert not any(k.startswith("dflash.rope.scaling") for k in _kv(exp))
    assert _kv(exp)["dflash.rope.freq_base"] == 500000.0
    assert any("rope_freqs" in line for line in exp.usage)


def test_yarn_keys_are_the_heads_rope(cases):
    """gpt-oss: the yarn keys hold the head's own RoPE parameters; the attention factor llama.cpp derives from the
    factor (0.1 ln(factor) + 1) is the one the head's rotary embedding scales cos/sin by."""
    target, head, record, state = cases["gpt_oss"]
    rope = head.config.rope_parameters
    exp = to_gguf(record, state, target.config)
    kv = _kv(exp)
    assert kv["dflash.rope.scaling.type"] == "yarn" and kv["dflash.rope.scaling.factor"] == rope["factor"] == 8.0
    assert kv["dflash.rope.scaling.original_context_length"] == rope["original_max_position_embeddings"] == 64
    assert (kv["dflash.rope.scaling.yarn_beta_fast"], kv["dflash.rope.scaling.yarn_beta_slow"]) == (32.0, 1.0)
    assert kv["dflash.rope.freq_base"] == rope["rope_theta"] == 150000.0
    assert math.isclose(head.rotary_emb.attention_scaling, 0.1 * math.log(rope["factor"]) + 1.0)
    assert "rope_freqs.weight" not in exp.tensors
    assert any("truncate=false" in line for line in exp.usage)  # what the file cannot carry
    target, head, record, state = cases["llama_linear"]
    kv = _kv(to_gguf(record, state, target.config))
    assert (kv["dflash.rope.scaling.type"], kv["dflash.rope.scaling.factor"], kv["dflash.rope.freq_base"]) == \
        ("linear", 4.0, 1e4)


@pytest.mark.parametrize("rope,match", [
    ({"rope_type": "dynamic", "factor": 2.0}, "RoPE type 'dynamic' is not one llama.cpp's dflash draft computes"),
    ({"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.0, "original_max_position_embeddings": 64},
     "attention factor 1 is not the 1.13863 llama.cpp's dflash draft computes"),
    ({"rope_type": "yarn", "factor": 4.0, "beta_fast": 16.0, "original_max_position_embeddings": 64},
     "beta_fast 16 is not the 32 llama.cpp's dflash draft"),
])
def test_a_rope_llamacpp_would_compute_otherwise_is_refused_in_one_line(cases, rope, match):
    """(A yarn RoPE without factor never gets here: the head's Qwen3Config refuses it.)"""
    target, head, record, state = cases["llama"]
    config = copy.deepcopy(target.config)  # the head's layers take the target's RoPE
    config.rope_parameters = {"rope_theta": 10000.0, **rope}
    with pytest.raises(UserError, match=match) as e:
        to_gguf(record, state, config)
    assert "\n" not in str(e.value)
