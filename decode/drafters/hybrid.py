"""Hybrid drafting: a trained head's draft and a lookup's (suffix or n-gram: no model) verified in ONE target pass,
so a user never gets less from a head than from the lookup that costs nothing (Arctic Inference's suffix + speculator,
SAM-Decoding + EAGLE-2). The head drafts the tokens a lookup cannot guess; the lookup drafts the spans a head cannot
afford to (long copies of the prompt or of the output so far).

Each round the lookup proposes first (microseconds) with its own estimate of the tokens it will get accepted
(`expected`), calibrated online against what the target then committed; the head's is its running mean. `mode`:

    tree    both drafts under one root (decode.draft.merge): the target picks whichever branch matches
    choose  the draft with the larger expected accepted length, alone (the head skipped when the lookup wins)
    auto    the head alone when the lookup expects less than `min_expected`, else the lookup with the head beside
            it (one tree) wherever the gate below finds the head pays at that estimate; without the gate (sampling,
            cost_gate=False) the lookup alone when it expects at least `skip_head_at` of the head's accepted tokens

A head only drafts where it pays: greedy, the hybrid times the head's part of each round it takes part in (its
drafting, and reading the positions it has not read yet) against the rest of the round, and lets the head draft only
while its mean gain exceeds that share (plus HEAD_MARGIN): the tokens the target accepted of its draft beyond those
the lookup's draft of the same round agrees with (a round with the head commits `gain` more tokens for 1 + share of a
round's time; weighing the share by the lookup's pace, share x (1 + expected), benched the head more and measured no
faster: docs/history.md, 2026-11-30). The gain is kept apart per band of the lookup's calibrated estimate (BANDS;
a round where the lookup has no draft is a band of its own, where the head's accepted tokens are all gain): beside a
sure copy the head adds little, beside an unsure one most of what it drafts alone. An eligible round drafts with it
anyway after `explore_every` benched ones of its band, an interval that doubles each time exploring finds the head
still not paying (up to MAX_EXPLORE) and resets once it pays, so a head that starts to pay is seen and one that never
does costs ever less. The head reads the verified positions lazily: their features wait until it next drafts (or
MAX_PENDING of them have piled up), then go in one pass, so a stretch of lookup rounds costs the head one batched
read. That read's share for the prompt and for the rounds before the last (the head sat them out) is timed apart and
counted in neither part of the round the gate scores: it is a one-off of starting or resuming, and the gate judges the
rounds to come, which read one round's positions each (charged to the head, a try after a long bench looked several
times dearer than the head's rounds are, and the head stayed benched).

Lossless: greedy verification is unchanged; under sampling every decision above depends only on the committed text
and on earlier rounds, never on this round's draws (the timing gate is greedy-only, so a sampled run is the same for
the same seed), and merge keeps a sampled head branch apart from the lookup's point masses, so
decode.verify.sample_tree stays exact.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from selfspec.decode.draft import Draft, Sampling, merge

MODES = ("auto", "tree", "choose")
HEAD_MARGIN = 0.05  # accepted tokens a head must clear beyond its share of a round's time
MAX_PENDING = 512  # verified positions the head may have left to read before it reads them anyway
BANDS = (0.5, 1.0, 2.0, 4.0)  # band edges of the lookup's calibrated estimate, each band gated apart (-1: no draft)
PRIOR_GAIN = 1.0  # a band's gain before its first round: the head drafts there until measured
MAX_EXPLORE = 64  # the longest run of benched rounds between two exploring ones


class HybridDrafter:
    def __init__(self, head, lookup, mode: str = "auto", skip_head_at: float = 1.0, min_expected: float = 0.3,
                 prior: float = 2.0, cost_gate: bool = True, explore_every: int = 8):
        """head: a head's drafter (EAGLE-1/3, DFlash, P-EAGLE, a draft model); lookup: a drafter with an `expected`
        attribute set by its propose (suffix.SuffixDrafter, ngram.NgramDrafter); skip_head_at, min_expected: auto's
        thresholds (above); prior: how many rounds of evidence the lookup's own estimate weighs against its
        calibration; cost_gate, explore_every: the head drafts only where it pays (above; greedy only)."""
        if mode not in MODES:
            raise ValueError(f"hybrid mode must be one of {', '.join(MODES)} (got {mode!r})")
        self.head, self.lookup, self.mode = head, lookup, mode
        self.skip_head_at, self.min_expected, self.prior = skip_head_at, min_expected, prior
        self.cost_gate, self.explore_every = cost_gate, explore_every
        self.name = f"hybrid:{head.name}+{lookup.name}"
        self.feature_layers = getattr(head, "feature_layers", None)  # the engine serves the head's features
        self.head_mean = 1.0  # running mean of the head's accepted tokens per drafted round (a first guess)
        # the gate's: the head's accepted tokens beyond what the lookup's draft would have had accepted in the same
        # round, per band of the lookup's calibrated estimate (_band; -1: it had no draft, the head's all gain)
        self.head_gain: dict[int, float] = {}  # band -> running mean (PRIOR_GAIN before its first round)
        self.head_cost = 0.0  # running mean of the head's share of a round's time, over the rest of it (greedy)
        self.calibration: dict[int, list[float]] = {}  # lookup estimate bucket -> [accepted sum, rounds]
        self.rounds = {"head": 0, "lookup": 0, "both": 0, "none": 0}
        self._last: Optional[tuple[Optional[Draft], Optional[Draft], Optional[Draft], int, int]] = None
        # (features, start, verified) the head has not read yet; verified: a round's positions (the prompt's are not)
        self._pending: list[tuple[torch.Tensor, int, bool]] = []
        self._round_start: Optional[float] = None
        self._head_s: Optional[float] = None  # the head's seconds in the current round (None: it sat out)
        self._skip_s = 0.0  # the current round's seconds reading the positions of rounds before it (_catch_up)
        self._benched: dict[int, int] = {}  # eligible rounds benched since the head last drafted, per band
        self._explore: dict[int, int] = {}  # benched rounds before the next exploring one, per band

    def reset(self, prompt_ids: torch.Tensor) -> None:
        self.head.reset(prompt_ids)
        self.lookup.reset(prompt_ids)
        self._last, self._pending, self._round_start, self._head_s, self._skip_s = None, [], None, None, 0.0

    def observe(self, seq: torch.Tensor, features: torch.Tensor, start: int) -> None:
        self._learn(seq, start)
        self.lookup.observe(seq, features, start)
        # the head reads them when it next drafts; the first after reset are the prompt's (no round has begun)
        self._pending.append((features, start, self._round_start is not None))
        if sum(f.shape[1] for f, _, _ in self._pending) >= MAX_PENDING:
            self._catch_up(seq)

    def _catch_up(self, seq: torch.Tensor) -> float:
        """The head reads every verified position it has not read, in one pass (they are contiguous: each round's
        start is the last round's start + the positions it verified). Returns the seconds of that read spent on the
        prompt's positions and the positions of the rounds before the last (what a head drafting every round would not
        read in this one), which the round's timing leaves out (_time_round)."""
        if not self._pending:
            return 0.0
        parts = [f for f, _, _ in self._pending]
        features = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
        start, (tail, _, verified) = self._pending[0][1], self._pending[-1]
        own = tail.shape[1] if verified else 0  # the last round's positions; the prompt's are a one-off too
        self._pending = []
        t = time.perf_counter()
        self.head.observe(seq, features, start)
        stale = (time.perf_counter() - t) * (features.shape[1] - own) / max(features.shape[1], 1)
        self._skip_s += stale
        return stale

    def propose(self, seq: torch.Tensor, max_depth: int, sampling: Sampling) -> Optional[Draft]:
        self._time_round(sampling)
        found = self.lookup.propose(seq, max_depth, sampling)
        bucket = _bucket(self.lookup.expected)
        expected = self._calibrated(bucket, self.lookup.expected) if found is not None else 0.0
        band = _band(expected) if found is not None else -1
        gated = self.cost_gate and sampling.greedy  # the timing gate (greedy only); in auto it alone admits the head
        use_head = found is None or not (
            (self.mode == "choose" and expected >= self.head_mean)
            or (self.mode == "auto" and not gated and expected >= self.skip_head_at * self.head_mean))
        use_lookup = found is not None and not (
            (self.mode == "choose" and use_head) or (self.mode == "auto" and expected < self.min_expected))
        drafted = None
        if use_head and (not gated or self._head_pays(band)):
            t = time.perf_counter()
            stale = self._catch_up(seq)
            drafted = self.head.propose(seq, max_depth, sampling)
            self._head_s = time.perf_counter() - t - stale
        lookup = found if use_lookup or (use_head and drafted is None) else None
        self._last = (drafted, lookup, found, bucket, band, seq.shape[1])
        if drafted is not None and lookup is not None:
            self.rounds["both"] += 1
            return merge(drafted, lookup)
        self.rounds["head" if drafted is not None else "lookup" if lookup is not None else "none"] += 1
        return drafted if lookup is None else lookup

    def _time_round(self, sampling: Sampling) -> None:
        """A round runs from one propose to the next: the head's share of the last one (greedy only: a sampled run
        must not depend on the clock, so that a seed repeats it)."""
        now = time.perf_counter()
        if self._round_start is not None and self._head_s is not None and sampling.greedy:
            rest = now - self._round_start - self._head_s - self._skip_s
            if rest > 0:
                self.head_cost += 0.2 * (self._head_s / rest - self.head_cost)
        self._round_start, self._head_s, self._skip_s = now, None, 0.0

    def _head_pays(self, band: int) -> bool:
        """The gate: whether the head drafts this round, by its gain in rounds of this band (the lookup's calibrated
        estimate) against its share of a round's time, or an exploring round (after ever more benched ones while it
        loses)."""
        if self.head_gain.get(band, PRIOR_GAIN) >= self.head_cost + HEAD_MARGIN:
            self._benched[band], self._explore[band] = 0, self.explore_every
            return True
        self._benched[band] = self._benched.get(band, 0) + 1
        if self._benched[band] < self._explore.get(band, self.explore_every):
            return False
        self._benched[band] = 0
        self._explore[band] = min(2 * self._explore.get(band, self.explore_every), MAX_EXPLORE)
        return True

    def _calibrated(self, bucket: int, own: float) -> float:
        """The lookup's accepted tokens at this estimate so far, shrunk towards its own estimate."""
        total, n = self.calibration.get(bucket, (0.0, 0))
        return (total + self.prior * own) / (n + self.prior)

    def _learn(self, seq: torch.Tensor, start: int) -> None:
        """After a verification pass: how many tokens of each draft the target's committed text bears out."""
        if self._last is None:
            return
        drafted, lookup, found_draft, bucket, band, L = self._last
        committed = seq[0, L:].tolist()  # the tokens after the root that this pass committed
        # greedy: what the lookup's draft would have had accepted is its agreement with the committed text (a draft
        # the round left out included), as far as that text goes
        found = _matched(found_draft, committed) if found_draft is not None else 0
        if drafted is not None:
            matched = _matched(drafted, committed)
            self.head_mean += 0.1 * (matched - self.head_mean)
            gain = self.head_gain.get(band, PRIOR_GAIN)
            self.head_gain[band] = gain + 0.1 * (max(matched - found, 0) - gain)
        if lookup is not None:
            stats = self.calibration.setdefault(bucket, [0.0, 0])
            stats[0] += found
            stats[1] += 1
        self._last = None


def _band(expected: float) -> int:
    return sum(expected >= edge for edge in BANDS)


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
