"""Any slice of a frozen target's decoder, run through its own public modules (layers, rotary embedding, HF's
masks): LayerSkip's exit drafts with layers [0, E), decode/kv.py verifies from layer E on, eval/exit_sweep.py reads
every exit."""

from __future__ import annotations

import inspect

import torch


def layer_types(config) -> list[str]:
    types = getattr(config, "layer_types", None)
    return list(types) if types else ["full_attention"] * config.num_hidden_layers


def _rope(decoder, hidden: torch.Tensor, position_ids: torch.Tensor, kinds) -> dict:
    """{layer type: (cos, sin)} from the target's own rotary embedding (Gemma3 has one per attention type)."""
    takes_type = "layer_type" in inspect.signature(decoder.rotary_emb.forward).parameters
    return {t: decoder.rotary_emb(hidden, position_ids, t) if takes_type else decoder.rotary_emb(hidden, position_ids)
            for t in kinds}


def _hf_masks(config, hidden, attention_mask, cache, position_ids, kinds) -> dict:
    """HF's own masks per attention type (training: causal + optional 2-D padding mask)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    kw = dict(config=config, inputs_embeds=hidden, attention_mask=attention_mask, past_key_values=cache,
              position_ids=position_ids)
    return {t: create_sliding_window_causal_mask(**kw) if t == "sliding_attention" else create_causal_mask(**kw)
            for t in kinds}


def run_layers(model, hidden: torch.Tensor, start: int, end: int, position_ids: torch.Tensor, cache=None,
               attention_mask=None, return_all: bool = False):
    """Decoder layers [start, end) of a *ForCausalLM over the residual stream `hidden` [B, T, H] -> [B, T, H].

    Uses the model's own layer modules and rotary embedding; extends `cache` (a DynamicCache) for those layers.
    attention_mask: a prepared mask (a [B, 1, T, S] tensor, or {layer type: mask} as decode/kv.py builds them;
    S = the cached length of THESE layers + T), or None / a 2-D padding mask [B, T] (HF's causal masks are built).
    return_all: the list [hidden, after layer start, ..., after layer end-1] instead of the last state.
    """
    decoder = model.get_decoder()
    config = decoder.config
    types = layer_types(config)
    kinds = set(types[start:end])
    states = [hidden]
    if not kinds:
        return states if return_all else hidden
    if attention_mask is None or (torch.is_tensor(attention_mask) and attention_mask.dim() == 2):
        masks = _hf_masks(config, hidden, attention_mask, cache, position_ids, kinds)
    elif isinstance(attention_mask, dict):
        masks = attention_mask
    else:
        masks = {t: attention_mask for t in kinds}
    rope = _rope(decoder, hidden, position_ids, kinds)
    for i in range(start, end):
        out = decoder.layers[i](hidden, attention_mask=masks[types[i]], position_embeddings=rope[types[i]],
                                position_ids=position_ids, past_key_values=cache, use_cache=cache is not None)
        hidden = out[0] if isinstance(out, tuple) else out
        states.append(hidden)
    return states if return_all else hidden
