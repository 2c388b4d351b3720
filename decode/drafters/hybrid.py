"""Hybrid drafting: a trained head's draft and a lookup's (suffix or n-gram: no model) verified in ONE target pass,
so a user never gets less from a head than from the lookup that costs nothing (Arctic Inference's suffix + speculator,
SAM-Decoding + EAGLE-2). The head drafts the tokens a lookup cannot guess; the lookup drafts the spans a head cannot
afford to (long copies of the prompt or of the output so far).

Each round the lookup proposes first (microseconds) with its own estimate of the tokens it will get accepted
(`expected`), calibrated online against what the target then committed; the head's is its running mean. `mode`:

    tree    both drafts under one root (decode.draft.merge): the target picks whichever branch matches
    choose  the draft with the larger expected accepted length, alone (the head skipped when the lookup wins)
    auto    the lookup alone when it expects at least `skip_head_at` of the head's accepted tokens (the head's draft
            costs a fraction of a target step, the lookup's nothing), the head alone when the lookup expects less
            than `min_expected`, else both as a tree

Lossless: greedy verification is unchanged; under sampling every decision above depends only on the committed text
and on earlier rounds, never on this round's draws, and merge keeps a sampled head branch apart from the lookup's
point masses, so decode.verify.sample_tree stays exact. The head observes every verified position whatever drafted
it, so skipping its draft costs it nothing later.
"""

from __future__ import annotations

from typing import Optional

import torch

from selfspec.decode.draft import Draft, Sampling, merge

MODES = ("auto", "tree", "choose")


class HybridDrafter:
    def __init__(self, head, lookup, mode: str = "auto", skip_head_at: float = 1.0, min_expected: float = 0.3,
                 prior: float = 2.0):
        """head: a head's drafter (EAGLE-1/3, DFlash, P-EAGLE, a draft model); lookup: a drafter with an `expected`
        attribute set by its propose (suffix.SuffixDrafter, ngram.NgramDrafter); skip_head_at, min_expected: auto's
        thresholds (above); prior: how many rounds of evidence the lookup's own estimate weighs against its
        calibration."""
        if mode not in MODES:
            raise ValueError(f"hybrid mode must be one of {', '.join(MODES)} (got {mode!r})")
        self.head, self.lookup, self.mode = head, lookup, mode
        self.skip_head_at, self.min_expected, self.prior = skip_head_at, min_expected, prior
        self.name = f"hybrid:{head.name}+{lookup.name}"
        self.feature_layers = getattr(head, "feature_layers", None)  # the engine serves the head's features
        self.head_mean = 1.0  # running mean of the head's accepted tokens per drafted round (a first guess)
        self.calibration: dict[int, list[float]] = {}  # lookup estimate bucket -> [accepted sum, rounds]
        self.rounds = {"head": 0, "lookup": 0, "both": 0}
        self._last: Optional[tuple[Optional[Draft], Optional[Draft], int, int]] = None

    def reset(self, prompt_ids: torch.Tensor) -> None:
        self.head.reset(prompt_ids)
        self.lookup.reset(prompt_ids)
        self._last = None

    def observe(self, seq: torch.Tensor, features: torch.Tensor, start: int) -> None:
        self._learn(seq, start)
        self.head.observe(seq, features, start)
        self.lookup.observe(seq, features, start)

    def propose(self, seq: torch.Tensor, max_depth: int, sampling: Sampling) -> Optional[Draft]:
        found = self.lookup.propose(seq, max_depth, sampling)
        bucket = _bucket(self.lookup.expected)
        expected = self._calibrated(bucket, self.lookup.expected) if found is not None else 0.0
        use_head = found is None or not (
            (self.mode == "choose" and expected >= self.head_mean)
            or (self.mode == "auto" and expected >= self.skip_head_at * self.head_mean))
        use_lookup = found is not None and not (
            (self.mode == "choose" and use_head) or (self.mode == "auto" and expected < self.min_expected))
        drafted = self.head.propose(seq, max_depth, sampling) if use_head else None
        lookup = found if use_lookup else None
        self._last = (drafted, lookup, bucket, seq.shape[1])
        if drafted is not None and lookup is not None:
            self.rounds["both"] += 1
            return merge(drafted, lookup)
        self.rounds["head" if lookup is None else "lookup"] += 1
        return drafted if lookup is None else lookup

    def _calibrated(self, bucket: int, own: float) -> float:
        """The lookup's accepted tokens at this estimate so far, shrunk towards its own estimate."""
        total, n = self.calibration.get(bucket, (0.0, 0))
        return (total + self.prior * own) / (n + self.prior)

    def _learn(self, seq: torch.Tensor, start: int) -> None:
        """After a verification pass: how many tokens of each draft the target's committed text bears out."""
        if self._last is None:
            return
        drafted, lookup, bucket, L = self._last
        committed = seq[0, L:].tolist()  # the tokens after the root that this pass committed
        if drafted is not None:
            self.head_mean += 0.1 * (_matched(drafted, committed) - self.head_mean)
        if lookup is not None:
            stats = self.calibration.setdefault(bucket, [0.0, 0])
            stats[0] += _matched(lookup, committed)
            stats[1] += 1
        self._last = None


def _bucket(expected: float) -> int:
    return min(int(expected * 2), 40)  # half-token buckets


def _matched(draft: Draft, committed: list[int]) -> int:
    """The longest root path of `draft` whose tokens the committed text begins with (what greedy accepted of it)."""
    children = draft.children()
    node, n = 0, 0
    while n < len(committed):
        node = next((c for c in children[node] if draft.tokens[c - 1] == committed[n]), None)
        if node is None:
            break
        n += 1
    return n
