"""Held-out acceptance: roll a head out on its own predictions, as decoding does, against the target's greedy path.

Eval sequences are held-out prompts continued by the target's own greedy decoding, so the data IS the path
speculative decoding verifies against. Every position i after the prompt roots a draft chain; depth d of a chain
is accepted iff its first d drafts all match the target's tokens. tau = 1 + sum_d P(first d drafts accepted)
(the bonus token counts), as decoding's tokens per target pass with a greedy chain.

EAGLE heads (`chain_hits`): the head drafts K tokens from (f_i, x_{i+1}); all chains are rolled out at once with
one head pass per depth and the attention pattern of unrolled drafting (`rollout_mask`): the chain started at i
attends to the true context u <= i plus its own earlier drafts.

DFlash heads (`block_hits`): every position a of the continuation is an anchor (the last committed token); the
head drafts x_{a+1}..x_{a+S-1} in ONE pass from the target's context before a, and the block's accepted prefix is
its drafts up to the first mismatch with the target's tokens. All anchors of a sequence go through one training
call (each block sees context u < a and itself: exactly what decoding's `draft_block` sees).

LayerSkip exits (`exit_acceptance`): a chain rooted at i drafts x_{i+1}, then runs layers 0..E-1 over its own
draft... which, while every draft so far matched, IS the greedy path. So one exit pass over the continuation gives
every chain's acceptance: depth d is accepted iff the exit's argmax matches the target's at positions i..i+d-1.
"""

from __future__ import annotations

from typing import Optional

import torch
from tqdm.auto import tqdm


def eval_sequences(data_cfg, target, prompts: int, new_tokens: int) -> list[tuple[torch.Tensor, int]]:
    """`prompts` held-out prompts (data.heldout_prompts) continued by the target's own greedy decoding for
    `new_tokens` tokens: the path decoding verifies. A progress bar on a terminal (this is minutes on a CPU)."""
    from selfspec.core.cli import read_once
    from selfspec.data.config import DataConfig
    from selfspec.data.tokenize import heldout_prompts

    data_cfg = read_once(data_cfg, DataConfig)  # the composed `data.*` read once: the prompts and their template
    chats = heldout_prompts(data_cfg, target.tokenizer, prompts, target.context)
    template = data_template(data_cfg, target.tokenizer)
    return [greedy_continuations(target, [chat], new_tokens, template)[0]
            for chat in progress(chats, "held-out prompts: the target's greedy continuations")]


@torch.no_grad()
def greedy_continuations(target, prompts: list[list[dict]], new_tokens: int,
                         chat_template: Optional[str] = None) -> list[tuple[torch.Tensor, int]]:
    """(ids [1, N] = prompt + greedy continuation, prompt length) per chat prompt, rendered with `chat_template`
    (None = the tokenizer's own; data_template gives the one training used)."""
    out = []
    device = target.model.device
    for messages in prompts:
        ids = target.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True,
            chat_template=chat_template)["input_ids"].to(device)
        full = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                     do_sample=False, pad_token_id=target.tokenizer.pad_token_id or 0)
        out.append((full, ids.shape[1]))
    return out


def data_template(data_cfg, tokenizer) -> Optional[str]:
    """The chat template `data.chat_template` names (chatml, a Jinja string), or None for the tokenizer's own: held-out
    prompts are rendered as the training data were (a base model has no template of its own)."""
    from selfspec.data.tokenize import resolve_chat_template

    return resolve_chat_template(tokenizer, data_cfg.chat_template) if data_cfg.chat_template else None


# ---------------------------------------------------------------------------------------------- EAGLE heads


def rollout_mask(n: int, step: int, device=None) -> torch.Tensor:
    """[1, 1, n, n*(step+1)] bool (True = attend) for unrolled depth `step` >= 1: query i sees step-0 keys
    u <= i and its own chain's keys at depths 1..step (key index k*n + i)."""
    mask = torch.zeros(n, n * (step + 1), dtype=torch.bool, device=device)
    mask[:, :n] = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    rows = torch.arange(n, device=device)
    for k in range(1, step + 1):
        mask[rows, k * n + rows] = True
    return mask[None, None]


def chain_acceptance(head, target, sequences: list[tuple[torch.Tensor, int]], depth: int,
                     features=None) -> dict:
    """Top-1 agreement with the target at draft depths 1..depth and the chain tau it implies.

    `features(ids) -> [1, N, F]`: the target features the head takes at step 0 (default: post-norm last hidden
    states, EAGLE-1/2; EAGLE-3 passes `aux_features`). Later depths feed the head its own output."""
    sequences = progress(sequences, f"held-out eval: rolling out chains of {depth}")
    return acceptance_from_hits(*chain_hits(head, target, sequences, depth, features))


def aux_features(head, target_model):
    """EAGLE-3's `features` for chain_acceptance: ids [1, N] -> the fused input of step 0 [1, N, 3H] (what
    decoding feeds after a target pass)."""

    def features(ids: torch.Tensor) -> torch.Tensor:
        return head.aux_states(target_model.get_decoder()(input_ids=ids, output_hidden_states=True).hidden_states)

    return features


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


# ---------------------------------------------------------------------------------------------- LayerSkip exits


@torch.no_grad()
def exit_acceptance(head, target, sequences: list[tuple[torch.Tensor, int]], depth: int) -> dict:
    """Held-out top-1 agreement of the exit with the target, and the chain-`depth` tau of self-speculation.

    sequences: (ids [1, N] = prompt + the target's greedy continuation, prompt length). On the greedy path the
    target's choice at position i is x_{i+1}; a chain rooted at i accepts depth d iff the exit matches at
    i..i+d-1 (its own drafts were the greedy tokens so far, so its context IS the path: see the module docstring)."""
    hits = torch.zeros(depth)
    chains = matched = positions = 0
    for ids, start in progress(sequences, f"held-out eval: exit agreement, chains of {depth}"):
        n = ids.shape[1]
        pos = torch.arange(n, device=ids.device)[None]
        if head.adapter_kind == "lora":
            h_e = head.prefix(ids, pos)
        else:
            h_e = target.model.get_decoder()(input_ids=ids, output_hidden_states=True).hidden_states[head.exit_layer]
        pred = head.to_target_ids(head.logits(head(h_e, pos)).argmax(-1))[0]  # [N]: predicts x_{i+1}
        first = max(start - 1, 0)  # the root of the first chain: the last prompt token
        match = (pred[first:n - 1] == ids[0, first + 1:]).float()  # [M]
        matched += int(match.sum())
        positions += match.numel()
        run = match
        for d in range(depth):  # run[i] = the matches at i..i+d all hold
            if d:
                run = run[:-1] * match[d:]
            hits[d] += run[: max(match.numel() - depth + 1, 0)].sum()
        chains += max(match.numel() - depth + 1, 0)
    if chains == 0:
        return {"tau": 1.0, "top1": 0.0, "chains": 0}
    ev = acceptance_from_hits(hits, chains)
    return {"tau": round(ev.pop("tau"), 4), "top1": round(matched / max(positions, 1), 4), **ev}


def progress(items, desc: str):
    """`items` with a progress bar on a terminal (none in logs or pipes), cleared when done."""
    return tqdm(items, desc=desc, leave=False, disable=None, dynamic_ncols=True)
