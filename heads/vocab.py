"""Reduced draft vocabularies: the N most frequent loss-masked (assistant) tokens of the training data.

The mapping is chosen once, saved in the head's checkpoint (`draft_vocab` buffer: draft id i -> target id
draft_vocab[i]) and never rebuilt when a head is fine-tuned (REFERENCE.md: rebuilding it broke acceptance).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch


def top_tokens(sequences: Iterable[tuple[Sequence[int], Sequence[int]]], vocab_size: int, n: int,
               always: Sequence[int] = ()) -> torch.Tensor:
    """Ids of the `n` most frequent masked tokens over (input_ids, loss_mask) pairs, most frequent first.
    `always` (e.g. end-of-turn ids) are included whatever their count; ties break by lower id."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids, mask in sequences:
        ids_t = torch.as_tensor(ids, dtype=torch.long)
        counts += torch.bincount(ids_t[torch.as_tensor(mask, dtype=torch.bool)], minlength=vocab_size)[:vocab_size]
    for t in always:
        counts[t] = counts.max() + 1
    n = min(n, vocab_size)
    # stable sort by (-count, id)
    order = torch.argsort(-counts * (vocab_size + 1) + torch.arange(vocab_size), stable=True)
    return order[:n].clone()


def coverage(draft_vocab: torch.Tensor, sequences: Iterable[tuple[Sequence[int], Sequence[int]]]) -> float:
    """Share of masked tokens that the draft vocabulary can express."""
    inside = torch.zeros(int(draft_vocab.max()) + 1, dtype=torch.bool)
    inside[draft_vocab] = True
    hit = total = 0
    for ids, mask in sequences:
        ids_t = torch.as_tensor(ids)[torch.as_tensor(mask, dtype=torch.bool)]
        total += ids_t.numel()
        hit += int(inside[ids_t.clamp(max=inside.numel() - 1)].logical_and(ids_t < inside.numel()).sum())
    return hit / max(total, 1)
