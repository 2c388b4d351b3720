"""DSpark drafting (methods/dspark/head.py): one DFlash pass over the block, then the block drawn slot by slot.

The context cache is DFlash's (methods/dflash/drafter.py): the target's states of COMMITTED positions only, so it
is never rolled back. A proposal from the committed sequence x_0..x_{L-1}:

    hidden = block_hidden(x_{L-1}, L-1, cache)         # [S, H]: slot k at position L-1+k drafts token L+k
    prev = x_{L-1}
    for k in 0 .. K-1:
        logits_k, conf_k = the slot's DFlash logits + markov bias(prev), its predicted acceptance
        (cut here when the product of conf_0..conf_k falls below min_confidence)
        d_k = argmax (greedy) or a draw from the processed row (sampling);  prev = d_k

Exactness: slot k's row depends only on the tokens drawn before it, and the token is an unconditioned draw from that
row (greedy: a point mass at its argmax), so decode.verify's chain rule, which compares each token's row with the
target's given the same prefix, stays exact. The cut before slot k reads conf_k, which depends on the tokens before
it but never on d_k itself, so a kept token is never biased towards likely ones; a shorter draft (none at all
included: the pass then commits the target's own token) is always lossless. llama.cpp cuts where one slot's
conf_k < p_min (common/speculative.cpp, draft-dspark); the product here is the chance the whole prefix is accepted,
speculators' calibration target for its dynamic draft length.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import torch

from selfspec.core.errors import UserError
from selfspec.decode.draft import Draft, Sampling, token_prob
from selfspec.decode.drafters import load_head_for, vocab_size_of
from selfspec.methods.dflash.drafter import DFlashDrafter


def per_pass(config: dict[str, Any]) -> int:
    """Tokens one pass of a DSpark head (its recorded config) drafts: S, slot 0 at the anchor drafting the token after
    it."""
    return int(config["block_size"])


class DSparkDrafter(DFlashDrafter):
    """DFlash's drafter (its context cache, reset and observe) with a block read anchor-first and drawn slot by slot.

    num_draft: slots verified per pass, at most S (None = S, the whole block); fewer when the running confidence
    drops below min_confidence (the confidence head's, else the drawn tokens' probabilities)."""

    name = "dspark"

    @staticmethod
    def drafts_per_pass(head) -> int:
        return per_pass({"block_size": head.block_size})

    def propose(self, seq: torch.Tensor, max_depth: int, sampling: Sampling) -> Optional[Draft]:
        L, K = seq.shape[1], min(self.num_draft, max_depth)
        hidden = self.head.block_hidden(seq[:, L - 1], L - 1, self.cache)[0, :K]  # [K, H]
        base, normed = self.head.logits(hidden), self.head.norm(hidden)  # one lm_head pass for the K slots
        prev, confidence = seq[0, L - 1:L], 1.0
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        for k in range(K):
            logits, conf = self.head.chain_step(base[k:k + 1], normed[k:k + 1], prev)
            if conf is not None and self.min_confidence > 0:  # slot k's predicted acceptance, before drawing it
                confidence *= float(torch.sigmoid(conf[0]))
                if confidence < self.min_confidence:
                    break
            d, row = self.vocab.choose(logits[0], sampling)
            tokens.append(self.vocab.target_id(d))
            if row is not None:
                rows.append(row)
            prev = prev.new_tensor([tokens[-1]])
            if conf is None and self.min_confidence > 0:  # no confidence head: DFlash's rule on the drawn token
                confidence *= token_prob(self.vocab.logits(logits[0]), d, row)
                if confidence < self.min_confidence:
                    break
        if not tokens:
            return None
        return Draft.chain(tokens, self.vocab.rows(torch.stack(rows)) if rows else None)


def build(target, head: Any = None, chain: bool = True, num_draft: Optional[int] = None,
          min_confidence: float = 0.0, head_revision: Optional[str] = None, **_):
    """One DFlash pass and S chained slots propose a block of S tokens; num_draft verifies only its first ones."""
    head = load_head_for(target, head, "dspark", head_revision)
    kind = getattr(head, "head_type", "?")
    if kind != "dspark":
        raise UserError(f"drafter=dspark needs a DSpark head; this head is '{kind}' (use drafter={kind})")
    if not chain:
        raise UserError("drafter=dspark drafts one block per pass, not a tree: set chain=true")
    if num_draft is not None and num_draft > head.block_size:  # a bench's K sweep passes K > block: said, not refused
        print(f"warning: num_draft={num_draft} is more than this DSpark head drafts per pass (block_size "
              f"{head.block_size}); verifying {head.block_size}", file=sys.stderr, flush=True)
    return DSparkDrafter(head, vocab_size_of(target), num_draft=num_draft, min_confidence=min_confidence)
