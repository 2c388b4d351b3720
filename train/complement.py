"""Heads that complement a lookup drafter (drafter=hybrid, decode/drafters/hybrid.py): `train.lookup_weight` scales
the loss of every position whose token the lookup would already have drafted, from the same token ids, at no target
cost. The hybrid verifies the lookup's draft beside the head's, so a head's capacity is worth most where the lookup
misses; lookup_weight < 1 spends it there (1 = off, every position alike; 0 = the lookup's hits not learnt at all).

A position k is a hit when the suffix drafter (decode/drafters/suffix.py, the hybrid's default lookup, with its
defaults) reading tokens 0..k-1 of the sequence proposes token k first, with probability >= its min_prob."""

from __future__ import annotations

from functools import lru_cache

import torch

from selfspec.decode.drafters.suffix import SuffixTrie, _TrieIndex

DEPTH, MIN_PROB = 24, 0.1  # the hybrid's lookup defaults (decode.drafters.LookupConfig)


def lookup_hits(ids: list[int], depth: int = DEPTH, min_prob: float = MIN_PROB) -> list[bool]:
    """hits[k]: the lookup over ids[:k] drafts ids[k] first. One pass over the sequence, the trie grown as it goes."""
    trie = SuffixTrie(depth)
    index = _TrieIndex(trie)
    hits = [False] * len(ids)
    for k in range(1, len(ids)):
        trie.extend(ids[k - 1:k])
        found = index.match(ids[max(0, k - depth + 1):k])
        if found is not None:
            token, _, p = max(index.children(found[0]), key=lambda c: c[2])
            hits[k] = token == ids[k] and p >= min_prob
    return hits


@lru_cache(maxsize=1 << 16)
def _hits_of(ids: tuple[int, ...]) -> torch.Tensor:
    """lookup_hits of one sequence, once: a sequence's hits depend on its ids alone, and every epoch after the first
    meets the same sequences again (pure Python: on an H200, batch 32, a step took 1.53 s with it recomputed each
    epoch against 0.64 s for the same run without lookup_weight)."""
    return torch.tensor(lookup_hits(list(ids)), dtype=torch.bool)


def lookup_weighted(batch: dict[str, torch.Tensor], weight: float) -> dict[str, torch.Tensor]:
    """The batch with its loss_mask [B, T] (0/1 on assistant tokens) scaled to `weight` at the lookup's hits."""
    ids, mask = batch["input_ids"], batch["loss_mask"].float()
    for b in range(ids.shape[0]):
        n = int(batch["attention_mask"][b].sum())
        mask[b, :n][_hits_of(tuple(ids[b, :n].tolist()))] *= weight
    return {**batch, "loss_mask": mask}
