"""KV caches and attention masks for verifying drafts on a Hugging Face decoder.

Caches are plain `DynamicCache()`s built WITHOUT the model config, so every layer (sliding-window ones too)
keeps all its keys: rolling back after a pass is then a slice (chains) or a gather (trees), and sliding
windows are applied by the masks we build, from token positions. (transformers 5.x `DynamicCache.crop(n)`
refuses positive n, and sliding-window cache layers drop old keys, which would make rollback impossible.)

Masks are boolean [1, 1, T, S] (True = attend) for SDPA and additive float for eager attention; models with
several attention types (Gemma3, Qwen2 with sliding layers) get a dict {layer type: mask}, which their
forward accepts as already prepared.
"""

from __future__ import annotations

from typing import Optional

import torch
from transformers import DynamicCache

from selfspec.target.model import lm_logits


def new_cache() -> DynamicCache:
    return DynamicCache()


def cache_length(cache: DynamicCache) -> int:
    return cache.get_seq_length() if cache.layers else 0


def truncate(cache: DynamicCache, length: int) -> None:
    """Keep the first `length` entries of every layer."""
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False) and layer.keys.shape[-2] > length:
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]


def keep_entries(cache: DynamicCache, prefix: int, keep: list[int]) -> None:
    """Keep the first `prefix` entries, then the entries prefix + keep (increasing indices into what follows
    the prefix), packed into contiguous slots: the accepted root-to-leaf path of a verified tree. The kept entries
    are written over the tree's own slots in place: the cache before them is never copied (a copy of it, as a
    concatenation makes, cost a tree pass ~14 MB of traffic at 300 tokens of SmolLM2 context, ~92 MB at 2,000)."""
    n = len(keep)
    if keep == list(range(n)):
        return truncate(cache, prefix + n)  # a chain: a slice, no copy
    idx = None
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", False):
            continue
        if idx is None or idx.device != layer.keys.device:
            idx = torch.tensor(keep, device=layer.keys.device) + prefix
        for name in ("keys", "values"):
            t = getattr(layer, name)  # [B, H, S, D]
            t[..., prefix:prefix + n, :] = t.index_select(-2, idx)  # index_select copies first: no overlap
            setattr(layer, name, t[..., :prefix + n, :])


def text_config(model):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def sliding_windows(config) -> dict[str, Optional[int]]:
    """{layer type: sliding window or None} for the attention types the model uses. A config without
    `layer_types` (Mistral, Phi-3, Qwen3-MoE) has one kind of layer, and HF slides it when `sliding_window` is set."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not types:
        return {"full_attention": window}
    return {t: window if t == "sliding_attention" else None for t in set(types)}


def needs_explicit_mask(config) -> bool:
    """Plain causal chains can use HF's own masks, unless some layer slides (we then mask by position)."""
    return any(w is not None for w in sliding_windows(config).values())


def attention_mask(config, past: int, block: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """Mask for T new tokens over `past` cached tokens (positions 0..past-1, contiguous) plus themselves.

    block [T, T] bool: which new tokens each new token attends to (lower-triangular for a chain, ancestors
    for a tree). positions [T]: absolute positions of the new tokens.
    """
    T = block.shape[0]
    device = positions.device
    allowed = torch.cat([torch.ones(T, past, dtype=torch.bool, device=device), block.to(device)], dim=1)
    key_pos = torch.cat([torch.arange(past, device=device), positions])
    return mask_from(config, allowed, positions, key_pos, dtype)


def mask_from(config, allowed: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor, dtype: torch.dtype):
    """allowed [T, S] bool (True = attend), positions of the T queries and S keys -> the model's mask: a
    [1, 1, T, S] tensor, or a {layer type: mask} dict for models with sliding layers (a sliding layer also
    needs query_pos - key_pos < window, HF's rule)."""
    windows = sliding_windows(config)
    masks = {}
    for layer_type, window in windows.items():
        m = allowed
        if window is not None:
            m = m & (query_pos[:, None] - key_pos[None, :] < window)
        masks[layer_type] = _format(config, m[None, None], dtype)
    if getattr(config, "layer_types", None) and any(w is not None for w in windows.values()):
        return masks  # models with sliding layers read attention_mask[layer_type]
    return masks["full_attention"] if "full_attention" in masks else next(iter(masks.values()))


def _format(config, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    impl = getattr(config, "_attn_implementation", "sdpa") or "sdpa"
    if impl == "eager":
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
    if impl.startswith("flash") or impl.startswith("flex"):
        raise ValueError(f"attention implementation '{impl}' cannot take a tree mask; load the target with sdpa")
    return mask


def decoder_forward(model, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: DynamicCache,
                    mask=None, logits_from: int = 0, feature_layers=None,
                    head=None) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass of a *ForCausalLM's decoder + lm_head: (features, logits [1, T', V]) with T' = T - logits_from
    (the prefill only needs the last logits). Features: the post-norm last hidden states [1, T, H], or with
    `feature_layers` the concatenated residual streams after those layers [1, T, len * H] (EAGLE-3).
    `head(h)` replaces the logits when given (greedy decoding passes decode.argmax.ScreenedArgmax: token ids
    [1, T']). Extends `cache`."""
    out = model.get_decoder()(input_ids=input_ids, position_ids=position_ids, past_key_values=cache,
                              attention_mask=mask, use_cache=True, output_hidden_states=bool(feature_layers))
    h = out.last_hidden_state
    logits = head(h[:, logits_from:]) if head is not None else lm_logits(model, h[:, logits_from:])
    if feature_layers:
        return torch.cat([out.hidden_states[k] for k in feature_layers], dim=-1), logits
    return h, logits


def decoder_forward_from(model, start_layer: int, hidden: torch.Tensor, position_ids: torch.Tensor,
                         cache: DynamicCache, mask, feature_layers=None,
                         head=None) -> tuple[torch.Tensor, torch.Tensor]:
    """`decoder_forward` for self-speculative drafters: the residual stream after `start_layer` layers, `hidden`
    [1, T, H], is already known (and layers 0..start_layer-1 already hold these T tokens in `cache`), so only
    layers start_layer..L-1 run, then the final norm and lm_head. `mask`: prepared by `attention_mask` over the
    cached entries of those later layers. `feature_layers` (each >= start_layer) and `head` as in `decoder_forward`."""
    from selfspec.heads.layers import run_layers

    decoder = model.get_decoder()
    states = run_layers(model, hidden, start_layer, decoder.config.num_hidden_layers, position_ids, cache, mask,
                        return_all=True)  # [h after start_layer, ..., h after L]
    h = decoder.norm(states[-1])
    logits = head(h) if head is not None else lm_logits(model, h)
    if feature_layers:
        return torch.cat([states[k - start_layer] for k in feature_layers], dim=-1), logits
    return h, logits
