"""The training-time test (TTT): unroll a head on its own outputs while training, as decoding rolls it out.

Every position t starts a draft chain; step j of all T chains runs in one head pass over one KV cache, with the
attention pattern of unrolled drafting (selfspec.eval.acceptance.rollout_mask, the pattern held-out eval rolls
chains out with): the chain started at t attends to the true context u <= t plus its own earlier steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.profiler import record_function

from selfspec.eval.acceptance import rollout_mask


@dataclass
class TTTConfig:
    """The training-time test unroll (`ttt.*`; methods/eagle/train.py adds its on-policy weights: EagleTTTConfig)."""

    steps: int = field(default=7, metadata={"help": "draft steps unrolled per position (EAGLE-3 uses 7)"})
    decay: float = field(default=0.8, metadata={"help": "loss weight of step j is decay**j"})


def acceptance(p: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """[B, T] the chance that speculative sampling accepts a draft from softmax(logits) against the target's
    distribution p (both over the same vocabulary): sum_x min(p(x), q(x)). No gradient."""
    with torch.no_grad():
        return torch.minimum(p, torch.softmax(logits.float(), dim=-1)).sum(-1)


def ttt_mask(attention_mask: torch.Tensor, step: int) -> torch.Tensor:
    """[B, 1, T, T*(step+1)] bool (True = attend) for TTT step `step`: rollout_mask's pattern (step-0 keys
    u <= t, chain t's own keys at steps 1..step) with padded key positions masked out."""
    b, t = attention_mask.shape
    keys = attention_mask.bool().repeat(1, step + 1)  # [B, T*(step+1)], key k*T + u is position u
    return rollout_mask(t, step, attention_mask.device) & keys[:, None, None, :]


def shift(x: torch.Tensor, k: int) -> torch.Tensor:
    """x[:, k:] right-padded with zeros back to length T (dim 1): entry t becomes x[:, t+k]."""
    pad = torch.zeros_like(x[:, :k])
    return torch.cat([x[:, k:], pad], dim=1)


def ttt_unroll(head, aux: torch.Tensor, ids: torch.Tensor, attn: torch.Tensor, steps: int):
    """Yield the head's output [B, T, H] at steps 0..steps-1 of the chains started at every position t:
    step j takes (previous output or fc(aux_t), x_{t+1+j}) at RoPE position t+j, with ttt_mask(attn, j)."""
    from transformers import DynamicCache

    b, t = ids.shape
    cache = DynamicCache()  # step j appends T keys: [step 0 | step 1 | ... ], as decoding's cache holds them
    hidden = aux  # [B, T, 3H]
    for j in range(steps):
        pos = (torch.arange(t, device=ids.device) + j)[None].expand(b, -1)
        with record_function("head forward"):  # a torch.profiler range (scripts/profile_step.py)
            hidden = head(hidden, shift(ids, 1 + j), pos, past_key_values=cache, attention_mask=ttt_mask(attn, j))
        yield hidden
