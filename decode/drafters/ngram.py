"""Prompt lookup (n-gram) drafting: no model, no training. Find the most recent earlier occurrence of the
sequence's last n tokens (n from max_ngram down to min_ngram) and propose the tokens that followed it.
`expected` after each propose: the length n of the match (0: none), the estimate the hybrid drafter calibrates."""

from __future__ import annotations

from typing import Optional

import torch

from selfspec.decode.draft import NUM_DRAFT, Draft, Sampling


class NgramDrafter:
    name = "ngram"

    def __init__(self, num_draft: Optional[int] = None, max_ngram: int = 3, min_ngram: int = 1):
        self.num_draft = NUM_DRAFT if num_draft is None else num_draft
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.expected = 0.0

    def reset(self, prompt_ids: torch.Tensor) -> None:
        pass

    def observe(self, seq: torch.Tensor, features: torch.Tensor, start: int) -> None:
        pass

    def propose(self, seq: torch.Tensor, max_depth: int, sampling: Sampling) -> Optional[Draft]:
        s = seq[0]
        L = s.shape[0]
        K = min(self.num_draft, max_depth)
        self.expected = 0.0
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            windows = s[: L - 1].unfold(0, n, 1)  # [L - n, n]: every earlier n-gram (the suffix itself excluded)
            hits = (windows == s[L - n:]).all(-1).nonzero().flatten()
            if hits.numel():
                start = int(hits[-1]) + n  # the most recent match; its continuation starts here
                cont = s[start: start + K].tolist()
                if cont:
                    self.expected = float(n)
                    # deterministic given the sequence: verified as a point mass under sampling
                    return Draft.chain(cont)
        return None
