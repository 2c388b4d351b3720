"""DFlash drafting (methods/dflash/head.py): one non-causal draft pass proposes a whole block of S-1 tokens.

The head reads the target's hidden states of its `target_layer_ids` (the engine returns them instead of post-norm
features because `feature_layers` is set, as for EAGLE-3) through a context cache of COMMITTED positions only:

    after the prefill      observe(features of positions 0..n-1)        cache holds 0..n-1, anchor x_n at n
    after a verify pass    observe(features of root..root+a)            the root and the a accepted drafts
    propose                draft_block(x_{L-1}, L-1, cache) -> [S-1, V_draft] logits, one row per block position

The verify pass also computes the target's states of the rejected drafts, but the engine hands over only the
accepted ones, so the cache is never rolled back: a rejection simply appends nothing for those positions.

Block positions are drafted independently given the anchor (no position sees another's sampled token). The chain
rule of decode.verify stays exact as long as each token comes with the distribution it was drawn from: greedy takes
each row's argmax (a point mass), sampling draws each position from its own processed row and keeps that row.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import torch

from selfspec.core.errors import UserError
from selfspec.decode.draft import Draft, Sampling, Vocab, independent_draft
from selfspec.decode.drafters import load_head_for, vocab_size_of


def per_pass(config: dict[str, Any]) -> int:
    """Tokens one pass of a DFlash head (its recorded config) drafts: S-1, the block's slot 0 being the anchor itself
    (a head read anchor-first drafts from it: S)."""
    return int(config["block_size"]) - 1


class DFlashDrafter:
    name = "dflash"

    def __init__(self, head, vocab_size: int, num_draft: Optional[int] = None, min_confidence: float = 0.0):
        """num_draft: block positions verified per pass, at most S-1 (None = S-1, the whole block); fewer when the
        block's running confidence drops below min_confidence (decode/draft.py: dynamic chain length)."""
        self.head = head
        self.block = self.drafts_per_pass(head)  # tokens one draft pass proposes
        self.num_draft = self.block if num_draft is None else min(int(num_draft), self.block)
        self.min_confidence = min_confidence
        # hidden_states indices of the head's layer ids (id i = the OUTPUT of decoder layer i = hidden_states[i + 1])
        self.feature_layers = [i + 1 for i in head.target_layer_ids]
        self.vocab = Vocab(vocab_size, head.draft_token_ids())  # draft ids -> the target's (decode/draft.py)
        self.cache = head.new_cache()

    @staticmethod
    def drafts_per_pass(head) -> int:
        return per_pass({"block_size": head.block_size})

    def reset(self, prompt_ids: torch.Tensor) -> None:
        self.cache = self.head.new_cache()

    def observe(self, seq: torch.Tensor, features: torch.Tensor, start: int) -> None:
        """features [1, T, n*H]: the target's states at the committed positions start .. start+T-1 (= L-2)."""
        if start != len(self.cache):
            raise RuntimeError(f"{self.name} context cache holds {len(self.cache)} positions, the engine sent "
                               f"{start}..")
        self.head.extend_cache(self.cache, self.head.context(features))

    def propose(self, seq: torch.Tensor, max_depth: int, sampling: Sampling) -> Optional[Draft]:
        L = seq.shape[1]
        K = min(self.num_draft, max_depth)
        logits = self.vocab.logits(self.head.draft_block(seq[:, L - 1], L - 1, self.cache)[0, :K])  # [K, V_draft]
        return independent_draft(self.vocab, logits, sampling, self.min_confidence)


def build(target, head: Any = None, chain: bool = True, num_draft: Optional[int] = None,
          min_confidence: float = 0.0, head_revision: Optional[str] = None, **_):
    """One draft pass proposes a block of S-1 tokens; num_draft verifies only its first ones (None = all S-1)."""

    head = load_head_for(target, head, "dflash", head_revision)
    kind = getattr(head, "head_type", "?")
    if kind != "dflash":
        raise UserError(f"drafter=dflash needs a DFlash head; this head is '{kind}' (use drafter={kind})")
    if not chain:
        raise UserError("drafter=dflash drafts one block per pass, not a tree: set chain=true")
    block = head.block_size - 1
    if num_draft is not None and num_draft > block:  # a bench's K sweep passes K > block too: said, not refused
        print(f"warning: num_draft={num_draft} is more than this DFlash head drafts per pass (block_size "
              f"{head.block_size}: {block} tokens); verifying {block}", file=sys.stderr, flush=True)
    return DFlashDrafter(head, vocab_size_of(target), num_draft=num_draft, min_confidence=min_confidence)
