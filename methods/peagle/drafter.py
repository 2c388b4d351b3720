"""P-EAGLE drafting (head.py): the head pass that reads the pairs the target just verified also drafts all K
tokens, from the anchor (the last verified pair) and K-1 mask slots after it.

    observe(features of positions start..start+T-1)   crop the cache to `start` (drops the last pass's slots), then
                                                      ONE head pass over the T real pairs and K-1 mask slots;
                                                      keep the outputs of the anchor and the slots [K, H]
    propose                                           their logits: depth d's token from row d-1, no second pass

As with DFlash, no depth sees another depth's sampled token, so each token comes with the distribution it was drawn
from (greedy: a point mass at the row's argmax; sampling: the processed row) and decode.verify's chain rule is exact.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from selfspec.core.errors import UserError
from selfspec.decode import kv
from selfspec.decode.draft import Draft, Sampling, Vocab, independent_draft
from selfspec.decode.drafters import load_head_for, vocab_size_of


def per_pass(config: dict[str, Any]) -> int:
    """Tokens one pass of a P-EAGLE head (its recorded config) drafts: its depth K."""
    return int(config["depth"])


class PEagleDrafter:
    name = "peagle"

    def __init__(self, head, vocab_size: int, num_draft: Optional[int] = None, min_confidence: float = 0.0):
        """num_draft: tokens verified per pass, at most the head's depth K (None = K); fewer when the running
        confidence drops below min_confidence (decode/draft.py: dynamic chain length)."""
        self.head = head
        self.num_draft = head.depth if num_draft is None else min(int(num_draft), head.depth)
        self.min_confidence = min_confidence
        self.feature_layers = list(head.aux_layers)  # the engine hands over these residual streams, as for EAGLE-3
        self.vocab = Vocab(vocab_size, head.draft_token_ids())  # draft ids -> the target's (decode/draft.py)
        self.cache = kv.new_cache()
        self.drafts: Optional[torch.Tensor] = None  # [K, H] outputs of the anchor and the K-1 slots

    def reset(self, prompt_ids: torch.Tensor) -> None:
        self.cache = kv.new_cache()
        self.drafts = None

    def observe(self, seq: torch.Tensor, features: torch.Tensor, start: int) -> None:
        """Real pairs (aux_t, x_{t+1}) for t = start .. start+T-1, then the K-1 slots at the positions after them."""
        t, slots = features.shape[1], self.num_draft - 1
        kv.truncate(self.cache, start)
        device = features.device
        hidden = torch.cat([features, features.new_zeros(1, slots, features.shape[2])], dim=1)
        ids = torch.cat([seq[:, start + 1:start + 1 + t], seq.new_zeros(1, slots)], dim=1)
        positions = torch.arange(start, start + t + slots, device=device)[None]
        masked = (torch.arange(t + slots, device=device) >= t)[None]
        out = self.head(hidden, ids, positions, self.cache, masked=masked)
        self.drafts = out[0, t - 1:]

    def propose(self, seq: torch.Tensor, max_depth: int, sampling: Sampling) -> Optional[Draft]:
        k = min(self.num_draft, max_depth)
        logits = self.vocab.logits(self.head.logits(self.drafts[:k]))  # [K, V_draft]
        return independent_draft(self.vocab, logits, sampling, self.min_confidence)


def build(target, head: Any = None, chain: bool = True, num_draft: Optional[int] = None,
          min_confidence: float = 0.0, head_revision: Optional[str] = None, **_):
    """One head pass reads the verified pairs and drafts K tokens; num_draft verifies only the first ones (None = K)."""

    head = load_head_for(target, head, "peagle", head_revision)
    kind = getattr(head, "head_type", "?")
    if kind != "peagle":
        raise UserError(f"drafter=peagle needs a P-EAGLE head; this head is '{kind}' (use drafter={kind})")
    if not chain:
        raise UserError("drafter=peagle drafts one chain per pass, not a tree: set chain=true")
    if num_draft is not None and num_draft > head.depth:
        raise UserError(f"num_draft={num_draft} is more than this P-EAGLE head drafts per pass (it was trained for "
                        f"depth {head.depth}): pass num_draft <= {head.depth}, or null for all {head.depth}")
    return PEagleDrafter(head, vocab_size_of(target), num_draft=num_draft, min_confidence=min_confidence)
