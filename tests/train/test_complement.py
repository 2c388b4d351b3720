"""train.lookup_weight (train/complement.py): the positions a lookup already drafts right weigh less, found by the
same suffix drafter the hybrid decodes with."""

from __future__ import annotations

import random

import torch

from selfspec.decode.draft import Sampling
from selfspec.decode.drafters.suffix import SuffixDrafter
from selfspec.train.complement import lookup_hits, lookup_weighted


def test_hits_are_where_the_suffix_drafter_drafts_the_next_token_first():
    rng = random.Random(0)
    ids = [rng.randrange(5) for _ in range(120)]
    hits = lookup_hits(ids)
    for k in range(1, len(ids)):
        d = SuffixDrafter(num_draft=1)  # the hybrid's lookup, fresh on the prefix
        draft = d.propose(torch.tensor([ids[:k]]), 1, Sampling())
        assert hits[k] == (draft is not None and draft.tokens[0] == ids[k]), k
    assert 0 < sum(hits) < len(ids)  # this text has both


def test_weighted_mask_scales_only_hits_on_assistant_tokens():
    ids = torch.tensor([[7, 1, 2, 3, 1, 2, 3, 1, 2, 3, 0, 0]])
    attn = torch.tensor([[1] * 10 + [0, 0]])
    loss = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 0]])
    out = lookup_weighted({"input_ids": ids, "attention_mask": attn, "loss_mask": loss}, 0.25)["loss_mask"]
    hits = torch.tensor(lookup_hits(ids[0, :10].tolist()) + [False, False])
    assert torch.equal(out[0], torch.where(hits, 0.25, 1.0) * loss[0])
    assert hits[5:10].all() and not hits[:4].any()  # "1 2 3" repeats: copied from the 4th token on


def test_a_sequences_hits_are_computed_once_and_every_epoch_gets_the_same_mask(monkeypatch):
    """The hits of a sequence met again (the next epoch) come from the cache, not a second pass over its tokens, and
    the weighted mask is the same; another sequence is computed afresh."""
    import selfspec.train.complement as complement

    calls = []
    monkeypatch.setattr(complement, "lookup_hits", lambda ids, *a: calls.append(ids) or lookup_hits(ids, *a))
    complement._hits_of.cache_clear()
    ids = torch.tensor([[9, 4, 5, 6, 4, 5, 6, 4, 5, 6]])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    first, again = (complement.lookup_weighted(batch, 0.5)["loss_mask"] for _ in range(2))
    assert torch.equal(first, again) and len(calls) == 1 and first.min() == 0.5
    complement.lookup_weighted({**batch, "input_ids": ids.flip(1)}, 0.5)
    assert len(calls) == 2
    complement._hits_of.cache_clear()
