"""The target's attention on a CPU: grouped key/value heads read in place under a mask too.

Hugging Face's `sdpa` attention hands SDPA grouped K/V heads (`enable_gqa`) only where no mask is given; a
verification pass (several rows over a cache) always has one, so it copies every layer's whole cache once per group
(`repeat_kv`) before attending: for SmolLM2-135M (9 query heads over 3 K/V heads, 30 layers) 41 MB of copies per
pass at 300 tokens of context. PyTorch's CPU kernel takes a mask and grouped heads together, with the same result to
the bit; one layer, 3 rows over the cache (2 vCPUs, an Intel Xeon with AMX, 2026-12-03):

    context      300    1000    2000
    repeat_kv    130     488    1018  us
    grouped       64     145     411  us

`use` switches a CPU target from `sdpa` to `sdpa_gqa` (registered with transformers' AttentionInterface, its masks
those of sdpa): the same SDPA call with `enable_gqa=True` where a mask is given on a CPU, HF's own sdpa everywhere
else (one row, no grouping, another device, the arguments it alone handles).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

NAME = "sdpa_gqa"
# What HF's sdpa alone handles: adds to the mask, updates a paged cache, refuses or warns of.
HF_ONLY = ("position_bias", "cache", "softcap", "output_attentions", "s_aux")


def sdpa_gqa_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """query [B, Hq, T, D], key/value [B, Hkv, S, D], attention_mask [B, 1, T, S] -> ([B, T, Hq, D], None)."""
    grouped = getattr(module, "num_key_value_groups", 1) > 1
    hf_only = any(kwargs.get(k) is not None and kwargs.get(k) is not False for k in HF_ONLY)
    if not grouped or attention_mask is None or query.device.type != "cpu" or hf_only:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, sdpa_gqa_forward)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


def use(model: torch.nn.Module) -> bool:
    """Switch `model` (on a CPU, HF's sdpa attention) to `sdpa_gqa`; True if it did."""
    p = next(model.parameters(), None)
    if p is None or p.device.type != "cpu" or getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    model.set_attn_implementation(NAME)
    return True
