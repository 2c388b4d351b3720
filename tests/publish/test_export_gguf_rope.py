"""format=gguf for targets whose RoPE is scaled: Llama 3.1's `llama3` (a rope_freqs tensor), gpt-oss's `yarn` and
Gemma 3's global `linear` (rope.scaling.* keys). The file is the one llama.cpp's own converter writes from the head's
speculators export (byte for byte), its factors are the RoPE the head trained with (transformers' own), and a RoPE
llama.cpp's `eagle3` draft would compute otherwise is refused in one line.

The converter comparison needs llama.cpp's tree (`make check-llamacpp` unpacks it to .llamacpp/src; or set
SELFSPEC_LLAMACPP_SRC and SELFSPEC_LLAMACPP_PYDEPS); without it those tests skip. The tiny targets' byte-level
tokenizer is not one of the converter's known BPE pre-tokenizers, so the converter runs with that one lookup answered
('default'): the tokenizer keys are the target's, copied into both files alike (write_gguf copies them from a target
GGUF), and everything the head itself decides is the converter's own code.
"""

import copy
import math

import numpy as np
import pytest
import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from selfspec.core.errors import UserError
from head_exports import rope_cases
from llamacpp_converter import convert_heads, named_like
from selfspec.methods.eagle3.head import build_eagle3
from selfspec.publish.export import GGUF_TYPES, diff_gguf, to_gguf, write_gguf
from tolerance import relative_bound

GEMMA3_LINEAR = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},  # Gemma 3 4B-27B
                 "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
# case -> (tiny family, config overrides, draft vocabulary: None = the target's). llama / gemma3: default RoPE.
CASES = {"llama3": ("llama3", {}, 32), "gpt_oss": ("gpt_oss", {}, None),
         "gemma3_linear": ("gemma3", {"rope_parameters": GEMMA3_LINEAR}, None), "llama": ("llama", {}, None),
         "gemma3": ("gemma3", {}, None)}
COMPARED = [(c, t) for c in ("llama3", "gpt_oss") for t in GGUF_TYPES] + \
    [(c, "f32") for c in ("gemma3_linear", "llama", "gemma3")]

def _head(target, vocab):
    draft = None if vocab is None else torch.tensor([3, 9, 17] + list(range(40, 40 + vocab - 3)))
    return build_eagle3(target.model, aux_layers=[1, 2, 3], vocab_size=vocab, draft_vocab=draft)  # 3 distinct layers


@pytest.fixture(scope="module")
def cases():
    return rope_cases(CASES, _head)


@pytest.fixture(scope="module")
def converted(cases, tmp_path_factory):
    """Every compared (case, outtype) through llama.cpp's convert_hf_to_gguf.py: speculators export of the head
    --target-model-dir <the target's config and tokenizer>. -> {(case, outtype): the converter's file}."""
    return convert_heads(cases, COMPARED, tmp_path_factory, "speculators")


@pytest.mark.llamacpp
@pytest.mark.parametrize("case,outtype", COMPARED)
def test_gguf_is_byte_identical_to_llamacpp_converter(tmp_path, cases, converted, case, outtype):
    """diff_gguf finds nothing, and with the converter's general.name / size_label (it derives them from the folder
    name) and the tokenizer keys copied from its file, the bytes are the same."""
    target, head, record, state = cases[case]
    ref = converted[case, outtype]
    exp = to_gguf(record, state, target.config, outtype)
    assert diff_gguf(ref, write_gguf(exp, record, tmp_path / "ours.gguf", ref)) == []
    assert write_gguf(named_like(exp, ref), record, tmp_path / "named.gguf", ref).read_bytes() == ref.read_bytes()


def _kv(exp):
    return {k: v for k, v, _, _ in exp.kv}


def test_rope_freqs_are_the_llama3_rope_the_head_trained_with(cases):
    """ggml divides each default frequency by rope_freqs[i]: so rope_freqs = default inv_freq / llama3 inv_freq, as
    transformers computes them for the head's layer (and as its rotary embedding holds them)."""
    target, head, record, state = cases["llama3"]
    exp = to_gguf(record, state, target.config)
    freqs, qtype = exp.tensors["rope_freqs.weight"]
    assert qtype == "F32" and freqs.dtype == np.float32 and list(exp.tensors)[0] == "rope_freqs.weight"
    default, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(head.config)  # transformers 5: not in the table
    llama3, scale = ROPE_INIT_FUNCTIONS["llama3"](head.config, None)
    assert scale == 1.0 and torch.equal(head.rotary_emb.inv_freq, llama3)
    # elementwise fp32 formulas, no reduction: ~24 roundings between the converter's (11) and transformers' (12) and
    # the division (tests/tolerance.py)
    assert torch.allclose(torch.from_numpy(freqs), default / llama3, rtol=relative_bound(torch.float32, 1, 24), atol=0)
    assert {1.0, 8.0} < set(freqs.tolist()) and len(set(freqs.tolist())) == 3  # high, low and one smoothed band
    assert not any(k.startswith("eagle3.rope.scaling") for k in _kv(exp))  # the converter writes no scaling keys


def test_yarn_keys_are_the_heads_rope(cases):
    """The yarn keys hold the head's own RoPE parameters; the attention factor llama.cpp derives from the factor
    (llama-context.cpp: 0.1 ln(factor) + 1) is the one the head's rotary embedding scales cos/sin by."""
    target, head, record, state = cases["gpt_oss"]
    rope = head.config.rope_parameters
    kv = _kv(to_gguf(record, state, target.config))
    assert kv["eagle3.rope.scaling.type"] == "yarn" and kv["eagle3.rope.scaling.factor"] == rope["factor"] == 8.0
    assert kv["eagle3.rope.scaling.original_context_length"] == rope["original_max_position_embeddings"] == 64
    assert (kv["eagle3.rope.scaling.yarn_beta_fast"], kv["eagle3.rope.scaling.yarn_beta_slow"]) == (32.0, 1.0)
    assert kv["eagle3.rope.freq_base"] == rope["rope_theta"] == 150000.0
    assert math.isclose(head.rotary_emb.attention_scaling, 0.1 * math.log(rope["factor"]) + 1.0)
    assert "rope_freqs.weight" not in to_gguf(record, state, target.config).tensors
    target, head, record, state = cases["gemma3_linear"]
    kv = _kv(to_gguf(record, state, target.config))
    assert (kv["eagle3.rope.scaling.type"], kv["eagle3.rope.scaling.factor"], kv["eagle3.rope.freq_base"]) == \
        ("linear", 8.0, 1e6)  # the global layers' RoPE, the one the head's layer takes


@pytest.mark.parametrize("rope,match", [
    ({"rope_type": "dynamic", "factor": 2.0}, "RoPE type 'dynamic'"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
      "original_max_position_embeddings": 64}, "RoPE type 'longrope'"),
    ({"rope_type": "yarn", "original_max_position_embeddings": 64}, "yarn RoPE without factor"),
    ({"rope_type": "yarn", "factor": 4.0, "beta_fast": 16.0, "original_max_position_embeddings": 64}, "beta_fast 16"),
    ({"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.0, "original_max_position_embeddings": 64},
     "attention factor 1"),
])
def test_a_rope_llamacpp_would_compute_otherwise_is_refused_in_one_line(cases, rope, match):
    target, head, record, state = cases["llama"]
    config = copy.deepcopy(target.config)  # a Llama target: the GGUF describes the target's own layer config
    config.rope_parameters = {"rope_theta": 10000.0, **rope}
    with pytest.raises(UserError, match=match) as e:
        to_gguf(record, state, config)
    assert "\n" not in str(e.value)
