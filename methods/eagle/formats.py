"""EAGLE-1 heads (head.py) out to the layouts serving engines load, and EAGLE-1 checkpoints of other
trainers in. Every engine builds the draft's decoder layer as a Llama layer (publish/formats/base.py layer_source).

Exports (tests/publish/test_export.py checks names and shapes):

    eagle        original EAGLE / vLLM `method: "eagle"` (vllm/model_executor/models/llama_eagle.py): a Llama config
                 with num_hidden_layers = the head's layers; `fc.weight` [H, 2H], `layers.N.*`; no embed_tokens or
                 lm_head (vLLM then shares the target's), no input_layernorm on layer 0, no final norm.
    speculators  speculators' EagleSpeculatorConfig ("eagle": fusion_fc.*, transformer.*; one decoder layer).
    sglang       SGLang LlamaForCausalLMEagle (python/sglang/srt/models/llama_eagle.py: fc WITH a bias; a reduced
                 vocabulary goes in --speculative-token-map).

What an engine would silently serve wrong is refused here with the reason: vLLM builds the EAGLE-1 fc without a
bias and its weight loader ignores unexpected `.bias` tensors; vLLM's EAGLE-1 model has no draft->target id map.

Imports (publish/importer.py `layout=`):

    eagle        SafeAILab EAGLE-1/2 (eagle/model/cnets1.py and cnets.py `Model`): config.json a LlamaConfig whose
                 num_hidden_layers is the head's; `fc.weight` [H, 2H] (`fc.bias` optional), `layers.N.*` with no
                 input_layernorm on layer 0, and `embed_tokens.weight` [V, H], the target's frozen embedding (its
                 shape is checked, then it is dropped: the head shares the target's). vLLM `eagle` and SGLang
                 LlamaForCausalLMEagle folders use the same names.
    speculators  `speculators_model_type: eagle` (fusion_fc.*, transformer.*), read with the export's renames
                 undone; HASS layernorms are refused.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

from selfspec.core.errors import UserError, reading
from selfspec.publish.formats.base import (DEFAULT_SPEC_TOKENS, TOKEN_MAP_NAME, Export, check_dims, check_llama_layer,
                                           float_dtype, layer_config, layer_kind, layer_source, sglang_flags,
                                           speculators_block, verifier_id, without_embedding)

EMBED_STUB = "model.embed_tokens.weight"  # the EAGLE-1 head's unused 1-row embedding; never exported
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


def _refuse_vllm_eagle1(record: dict[str, Any], fmt: str) -> None:
    head = record["head"]
    if head.get("fc_bias"):
        raise UserError(f"format={fmt} refused: this head has an fc bias, and vLLM builds the EAGLE fc without one and "
                        "silently drops `fc.bias` (llama_eagle.py fc bias=False; AutoWeightsLoader ignores unexpected "
                        "'.bias'), so it would serve a different head; retrain with draft.fc_bias=false, or use "
                        "format=sglang")
    if head.get("vocab_size"):
        raise UserError(f"format={fmt} refused: this head drafts over a reduced vocabulary ({head['vocab_size']} "
                        "tokens) "
                        "and vLLM's EAGLE-1 model (llama_eagle.py) has no draft->target id map; pass "
                        "expand_vocab=true to draft over the full vocabulary (the shipped head's held-out tau: 2.431 "
                        "reduced, 2.444 full; docs/results.md), retrain with draft.vocab_size=null, or use "
                        "format=sglang (it takes the map as --speculative-token-map)")


# ---------------------------------------------------------------------------------------------- export


def to_eagle(record, state, target_config, spec_tokens: int = DEFAULT_SPEC_TOKENS) -> Export:
    """Original EAGLE / vLLM `method: "eagle"` layout."""
    head = record["head"]
    check_llama_layer(record, state, "eagle", "vLLM")
    _refuse_vllm_eagle1(record, "eagle")
    tensors = _eagle1_layers(state)
    # vLLM rewrites LlamaForCausalLM -> EagleLlamaForCausalLM (transformers_utils/configs/eagle.py).
    config = layer_config(layer_source(record, target_config), head.get("num_layers", 1), float_dtype(state),
                          architectures=["LlamaForCausalLM"])
    usage = [f'vllm.LLM(model="{verifier_id(record)}", speculative_config={{"method": "eagle", "model": "<out>", '
             f'"num_speculative_tokens": {spec_tokens}}})']
    return Export(config, tensors, usage=usage)


def to_speculators(record, state, target_config, spec_tokens: int = DEFAULT_SPEC_TOKENS) -> Export:
    """speculators' EAGLE-1 type, for speculators-aware tools (vLLM reads EAGLE-1 heads as format=eagle)."""
    head = record["head"]
    dtype = float_dtype(state)
    check_llama_layer(record, state, "speculators", "speculators")
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
        "speculators_config": speculators_block(record, target_config, "eagle", spec_tokens),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    usage = ["speculators' EAGLE-1 type ('eagle') for speculators-aware tools; vLLM 0.32 reads only EAGLE-3 (and "
             "newer) speculators types: serve EAGLE-1 heads in vLLM with format=eagle"]
    return Export(config, tensors, usage=usage)


def to_sglang(record, state, target_config, spec_tokens: int = DEFAULT_SPEC_TOKENS) -> Export:
    """SGLang's EAGLE draft model folder (LlamaForCausalLMEagle)."""
    head = record["head"]
    dtype = float_dtype(state)
    base = verifier_id(record)
    flags = sglang_flags(spec_tokens)
    check_llama_layer(record, state, "sglang", "SGLang")
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


def read_back(record: dict[str, Any], tensors: dict[str, torch.Tensor], folder: Path) -> dict[str, torch.Tensor]:
    """An export of ours (any of the three layouts) -> the selfspec state: the embedding stub is restored (zeros: it
    is never read), SGLang's zero fc bias dropped and SGLang's token map read back."""
    fix = "; export the head again"
    state = eagle1_state(tensors)
    if not record["head"].get("fc_bias") and "fc.bias" in state:
        if torch.count_nonzero(state["fc.bias"]):
            raise UserError(f"'{folder}': fc.bias is non-zero but the head was recorded without a bias")
        del state["fc.bias"]
    hidden = state["fc.weight"].shape[0]  # fc: [H, 2H]
    state[EMBED_STUB] = torch.zeros(1, hidden, dtype=state["fc.weight"].dtype)
    if (folder / TOKEN_MAP_NAME).exists():
        with reading("export token map", folder / TOKEN_MAP_NAME, fix=fix):
            state["draft_vocab"] = torch.tensor(torch.load(folder / TOKEN_MAP_NAME, weights_only=True),
                                                dtype=torch.long)
    return state


def eagle1_state(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """EAGLE-layout or speculators EAGLE-1 tensors -> selfspec EagleHead keys (`fc.*`, `model.layers.N.*`): the
    renames of `_eagle1_layers` and `SPECULATORS_EAGLE1` undone. No embedding stub (the caller adds it); also what
    `_import` reads checkpoints written by other trainers with."""
    state: dict[str, torch.Tensor] = {}
    for k, v in tensors.items():
        for ours, theirs in SPECULATORS_EAGLE1.items():
            if k.startswith(theirs):
                k = ours + k.removeprefix(theirs)
        state[k if k.startswith("fc.") else "model." + k] = v
    return state


# ---------------------------------------------------------------------------------------------- import


def detect(cfg: dict[str, Any], tensors: dict[str, torch.Tensor]) -> bool:
    """An EAGLE-1 folder of another trainer: an fc and decoder layers (DFlash and EAGLE-3 are told apart first)."""
    return "fc.weight" in tensors and any(k.startswith("layers.") for k in tensors)


def import_eagle(cfg: dict[str, Any], tensors: dict[str, torch.Tensor], target, aux_layers, src: Path):
    """layout=eagle: SafeAILab EAGLE-1/2 (and vLLM `eagle`, SGLang LlamaForCausalLMEagle) -> (head config, state)."""
    return _import(tensors, cfg, target, aux_layers, src)


def import_speculators(cfg: dict[str, Any], tensors: dict[str, torch.Tensor], target, aux_layers, src: Path):
    """layout=speculators, speculators_model_type eagle -> (head config, state)."""
    layer_cfg = cfg.get("transformer_layer_config") or {}
    if cfg.get("layernorms"):
        raise UserError(f"'{src}': speculators EAGLE-1 with layernorms=true (HASS: norms on the embedding and "
                        "before the lm_head) has no place in selfspec's EAGLE-1 head")
    return _import(tensors, {**layer_cfg, "num_hidden_layers": 1}, target, aux_layers, src)


def _import(tensors, layer_cfg: dict[str, Any], target, aux_layers, src: Path):
    if aux_layers is not None:
        raise UserError("aux_layers is for EAGLE-3 heads; this is an EAGLE-1 checkpoint")
    check_dims(layer_cfg, target, src)
    tensors = without_embedding(tensors, target, src)
    state = eagle1_state({k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")})  # derived
    if "model.layers.0.input_layernorm.weight" in state:
        raise UserError(f"'{src}' has an input_layernorm on layer 0; EAGLE (and selfspec's EAGLE-1 head) feeds fc's "
                        "output straight into the layer, so this head would be served without it")
    if "fc.weight" not in state:
        raise UserError(f"'{src}' has no fc.weight (fusion_fc.weight): not an EAGLE-1 head")
    found = sorted({int(k.split(".")[2]) for k in state if k.startswith("model.layers.")})
    n = int(layer_cfg.get("num_hidden_layers") or len(found))
    if found != list(range(n)):
        raise UserError(f"'{src}': its config says {n} decoder layer(s) but the weights hold layers {found}")
    hidden = state["fc.weight"].shape[0]
    state[EMBED_STUB] = torch.zeros(1, hidden, dtype=state["fc.weight"].dtype)  # never read: inputs_embeds
    return {"type": "eagle", "num_layers": n, "fc_bias": "fc.bias" in state, "layer": layer_kind(state)}, state


EXPORTERS = {"eagle": to_eagle, "speculators": to_speculators, "sglang": to_sglang}
IMPORTERS = {"eagle": import_eagle, "speculators": import_speculators}
