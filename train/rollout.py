"""Held-out acceptance while training: roll the head out on its own predictions, as decoding does.

Eval sequences are held-out prompts continued by the target's own greedy decoding, so the data IS the path
speculative decoding verifies against. At every continuation position i the head drafts K tokens from
(f_i, x_{i+1}); all chains are rolled out at once with one head pass per depth and the attention pattern of
unrolled drafting: the chain started at i attends to the true context u <= i plus its own earlier drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TTTConfig:
    """The training-time test unroll (`ttt.*`)."""

    steps: int = 7  # draft steps unrolled per position (EAGLE-3 uses 7)
    decay: float = 0.8  # loss weight of step j is decay**j


def rollout_mask(n: int, step: int, device=None) -> torch.Tensor:
    """[1, 1, n, n*(step+1)] bool (True = attend) for unrolled depth `step` >= 1: query i sees step-0 keys
    u <= i and its own chain's keys at depths 1..step (key index k*n + i)."""
    mask = torch.zeros(n, n * (step + 1), dtype=torch.bool, device=device)
    mask[:, :n] = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    rows = torch.arange(n, device=device)
    for k in range(1, step + 1):
        mask[rows, k * n + rows] = True
    return mask[None, None]


@torch.no_grad()
def greedy_continuations(target, prompts: list[list[dict]], new_tokens: int) -> list[tuple[torch.Tensor, int]]:
    """(ids [1, N] = prompt + greedy continuation, prompt length) per chat prompt."""
    out = []
    device = target.model.device
    for messages in prompts:
        ids = target.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                   return_dict=True)["input_ids"].to(device)
        full = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                     do_sample=False, pad_token_id=target.tokenizer.pad_token_id or 0)
        out.append((full, ids.shape[1]))
    return out


def chain_acceptance(head, target, sequences: list[tuple[torch.Tensor, int]], depth: int,
                     features=None) -> dict:
    """Top-1 agreement with the target at draft depths 1..depth and the chain tau it implies.

    `features(ids) -> [1, N, F]`: the target features the head takes at step 0 (default: post-norm last hidden
    states, EAGLE-1/2; EAGLE-3 passes its fused aux layers). Later depths feed the head its own output."""
    return acceptance_from_hits(*chain_hits(head, target, sequences, depth, features))


def acceptance_from_hits(hits: torch.Tensor, chains: int) -> dict:
    """chain_hits' counts -> {tau, chains, acc@d (acceptance at depth d given depths < d accepted)}."""
    if chains == 0:
        return {"tau": 1.0, "chains": 0}
    depth = len(hits)
    cum = hits / chains  # P(first d drafts accepted)
    cond = [float(cum[0])] + [float(cum[d] / cum[d - 1]) if cum[d - 1] > 0 else 0.0 for d in range(1, depth)]
    return {"tau": 1.0 + float(cum.sum()), "chains": chains,
            **{f"acc@{d + 1}": round(c, 4) for d, c in enumerate(cond)}}


@torch.no_grad()
def chain_hits(head, target, sequences: list[tuple[torch.Tensor, int]], depth: int,
               features=None) -> tuple[torch.Tensor, int]:
    """-> (hits [depth]: chains whose first d drafts all match the target, d = 1..depth; number of chains).
    Counts add up over sequences, so any grouping of sequences gives chain_acceptance of that group."""
    from transformers import DynamicCache

    hits = torch.zeros(depth)  # chains whose first d drafts all match, d = 1..depth
    chains = 0
    for ids, start in sequences:
        n_tok = ids.shape[1]
        if features is not None:
            feats = features(ids)  # [1, N, F]
        else:
            feats = target.model.get_decoder()(input_ids=ids).last_hidden_state  # [1, N, H] post-norm
        n = n_tok - 1  # head inputs: pairs (f_i, x_{i+1}), i = 0..N-2
        cache = DynamicCache()
        pos = torch.arange(n, device=ids.device)[None]
        hidden = head(feats[:, :n], ids[:, 1:], pos, past_key_values=cache)
        alive = torch.ones(n, dtype=torch.bool, device=ids.device)
        first = max(start - 1, 0)
        last = n_tok - depth - 2  # chains with all `depth` answers inside the sequence
        if last < first:
            continue
        for d in range(depth):
            token = head.to_target_ids(head.logits(hidden).argmax(-1))  # [1, n] predicts x_{i+d+2}
            want = torch.full_like(token, -1)
            want[:, : n_tok - d - 2] = ids[:, d + 2:]
            alive &= (token == want)[0]
            hits[d] += alive[first:last + 1].sum().item()
            if d + 1 < depth:
                hidden = head(hidden, token, pos + d + 1, past_key_values=cache,
                              attention_mask=rollout_mask(n, d + 1, ids.device))
        chains += last - first + 1
    return hits, chains


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
        hidden = head(hidden, shift(ids, 1 + j), pos, past_key_values=cache, attention_mask=ttt_mask(attn, j))
        yield hidden
