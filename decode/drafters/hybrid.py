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
does costs ever less; and it waits until the head's read of the positions it has not read would cost at most
1/EXPLORE_READ of the time since it last read (after a long bench, or before it has read a long prompt, that read is
what a try costs). The head reads the verified positions lazily: their features wait until it next drafts (or
MAX_PENDING of them have piled up), then go in one pass, so a stretch of lookup rounds costs the head one batched
read. That read's share for the prompt and for the rounds before the last (the head sat them out) is timed apart and
counted in neither part of the round the gate scores: it is a one-off of starting or resuming, and the gate judges the
rounds to come, which read one round's positions each (charged to the head, a try after a long bench looked several
times dearer than the head's rounds are, and the head stayed benched).

The trim (greedy, `trim`): a verification pass does not cost the same per row. On SmolLM2 fp32 here a pass of 2-3 rows
cost 74-79 ms and one of 4 rows 104 (MKL's sgemm and oneDNN's packed kernel both step up from 3 rows to 4), and the
4-row rounds committed fewer tokens a second than the 3-row ones. So the round's draft (the head's and the lookup's,
merged) is cut to its n likeliest nodes for the n that maximises (1 + their values) / (the head's time this round + a
round's other time at 1 + n rows): each node's value is what the target accepted so far of the nodes of its source
(the head's alone, the lookup's beside a head that drafted otherwise, both's, the lookup's in a round without the
head), score tenth (Draft.scores: a chain's confidence, a lookup's path probability) and, for the lookup's nodes, the
length class of the lookup's draft (_span: a long draft follows a long match, a surer copy at the same score), shrunk
towards the score, and never above its parent's; a round's other time is measured per row count in this run (rows
not yet seen cost what the most rows seen below them did, so a longer draft is tried before it is judged; fewer rows
than any seen, what the fewest did; each row count's time is the median of its latest 9 rounds, never above what more
rows cost, so that one preempted pass cannot price a row count out of use: with a running mean one slow 4-row round
priced 4 rows at 150-190 ms against 100-110 measured, and the trim, avoiding them, never measured them again).

A chain head (EAGLE-1/3) stops drafting where the trim would cut what it drafts next (greedy, trim): after each token
it asks keep_drafting(tokens, scores), which prices the round with the lookup's draft, the chain so far, and m more
tokens at the chain's next confidences (its running probability per step), each step's measured time added, and
lets it go on only if some m raises the round's tokens a second. A head step costs 4-5 ms here (its weights come from
memory each round): without the stop the EAGLE-1 head drafted 2.1-2.5 tokens a round of which the trim kept 1.3-1.5.

Lossless: greedy verification is unchanged; under sampling every decision above depends only on the committed text
and on earlier rounds, never on this round's draws (the timing gate and the trim are greedy-only, so a sampled run is
the same for the same seed), and merge keeps a sampled head branch apart from the lookup's point masses, so
decode.verify.sample_tree stays exact.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from typing import Optional

import torch

from selfspec.decode.draft import Draft, Sampling, merge

MODES = ("auto", "tree", "choose")
HEAD_MARGIN = 0.05  # accepted tokens a head must clear beyond its share of a round's time
MAX_PENDING = 512  # verified positions the head may have left to read before it reads them anyway
BANDS = (0.5, 1.0, 2.0, 4.0)  # band edges of the lookup's calibrated estimate, each band gated apart (-1: no draft)
PRIOR_GAIN = 1.0  # a band's gain before its first round: the head drafts there until measured
MAX_EXPLORE = 64  # the longest run of benched rounds between two exploring ones
ROW_WINDOW = 9  # the latest rounds of a row count whose median is its time (_time_round)
# an exploring round waits until its read of the positions the head has not read (the prompt's, the benched rounds')
# would cost at most 1/EXPLORE_READ of the time since the head last read (llama.cpp's gate waits 50 times a try's loss)
EXPLORE_READ = 50.0
SCORE_PRIOR = 4.0  # nodes of evidence a drafter's own node score weighs against its calibration (_node_value)
# a node's source, each calibrated apart: the head's alone, the lookup's beside a head that drafted otherwise, both's,
# the lookup's in a round the head sat out
SOURCES = ("head", "lookup", "both", "alone")


class HybridDrafter:
    def __init__(self, head, lookup, mode: str = "auto", skip_head_at: float = 1.0, min_expected: float = 0.3,
                 prior: float = 2.0, cost_gate: bool = True, explore_every: int = 8, trim: bool = True):
        """head: a head's drafter (EAGLE-1/3, DFlash, P-EAGLE, a draft model); lookup: a drafter with an `expected`
        attribute set by its propose (suffix.SuffixDrafter, ngram.NgramDrafter); skip_head_at, min_expected: auto's
        thresholds (above); prior: how many rounds of evidence the lookup's own estimate weighs against its
        calibration; cost_gate, explore_every: the head drafts only where it pays (above; greedy only); trim: each
        round's draft cut to the nodes that pay for their rows (below; greedy only)."""
        if mode not in MODES:
            raise ValueError(f"hybrid mode must be one of {', '.join(MODES)} (got {mode!r})")
        self.head, self.lookup, self.mode = head, lookup, mode
        self.skip_head_at, self.min_expected, self.prior = skip_head_at, min_expected, prior
        self.cost_gate, self.explore_every, self.trim = cost_gate, explore_every, trim
        # the trim's: each drafter's node scores against what the target accepted ((drafter, score tenth) ->
        # [accepted, nodes]), and a round's time outside the head by the rows it verified (rows -> the median of its
        # latest ROW_WINDOW rounds, s)
        self.node_calibration: dict[tuple[str, int, int], list[float]] = {}
        self._span = 0  # the current round's lookup draft length class (_span): its nodes are calibrated apart
        self.row_seconds: dict[int, float] = {}
        self._row_times: dict[int, deque] = {}  # rows -> its latest rounds' times
        # the stop's (_keep_drafting): running means of a chain head's step (s) and of its tokens' probability after
        # the first (a first guess until measured)
        self.step_s: Optional[float] = None
        self.step_prob = 0.7
        self._rows = 0  # the rows (root + draft) the current round verifies
        self.name = f"hybrid:{head.name}+{lookup.name}"
        self.feature_layers = getattr(head, "feature_layers", None)  # the engine serves the head's features
        self.head_mean = 1.0  # running mean of the head's accepted tokens per drafted round (a first guess)
        # the gate's: the head's accepted tokens beyond what the lookup's draft would have had accepted in the same
        # round, per band of the lookup's calibrated estimate (_band; -1: it had no draft, the head's all gain)
        self.head_gain: dict[int, float] = {}  # band -> running mean (PRIOR_GAIN before its first round)
        self.head_cost = 0.0  # running mean of the head's share of a round's time, over the rest of it (greedy)
        self.calibration: dict[int, list[float]] = {}  # lookup estimate bucket -> [accepted sum, rounds]
        self.rounds = {"head": 0, "lookup": 0, "both": 0, "none": 0}
        # (head's draft, lookup's proposal, its bucket, band, L, the round's draft before the trim, its nodes' sources)
        self._last: Optional[tuple] = None
        # (features, start, verified) the head has not read yet; verified: a round's positions (the prompt's are not)
        self._pending: list[tuple[torch.Tensor, int, bool]] = []
        self._round_start: Optional[float] = None
        self._head_s: Optional[float] = None  # the head's seconds in the current round (None: it sat out)
        self._skip_s = 0.0  # the current round's seconds reading the positions of rounds before it (_catch_up)
        self._benched: dict[int, int] = {}  # eligible rounds benched since the head last drafted, per band
        self._explore: dict[int, int] = {}  # benched rounds before the next exploring one, per band
        self.explore_read = EXPLORE_READ  # 0: explore whatever the read costs (_head_pays)
        self._read_rate: Optional[float] = None  # the head's seconds a position read, its latest batched read's
        self._read_at = time.perf_counter()  # when the head last read (or the request began: its prompt is unread)

    def reset(self, prompt_ids: torch.Tensor) -> None:
        self.head.reset(prompt_ids)
        self.lookup.reset(prompt_ids)
        self._last, self._pending, self._round_start, self._head_s, self._skip_s = None, [], None, None, 0.0
        self._read_at = time.perf_counter()

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
        self._read_at = time.perf_counter()
        if features.shape[1] >= 16:  # a batch long enough to time per position
            self._read_rate = (self._read_at - t) / features.shape[1]
        stale = (self._read_at - t) * (features.shape[1] - own) / max(features.shape[1], 1)
        self._skip_s += stale
        return stale

    def propose(self, seq: torch.Tensor, max_depth: int, sampling: Sampling) -> Optional[Draft]:
        self._time_round(sampling)
        found = self.lookup.propose(seq, max_depth, sampling)
        self._span = _span(len(found)) if found is not None else 0
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
            ask = self.trim and sampling.greedy and bool(self.row_seconds) and hasattr(self.head, "keep_drafting")
            if ask:  # a chain head stops where its next tokens would be cut (_keep_drafting)
                budget = min(getattr(self.head, "num_draft", max_depth), max_depth)
                self.head.keep_drafting = self._keep_drafting(found if use_lookup else None, t + stale, budget)
            try:
                drafted = self.head.propose(seq, max_depth, sampling)
            finally:
                if ask:
                    self.head.keep_drafting = None
            self._head_s = time.perf_counter() - t - stale
        lookup = found if use_lookup or (use_head and drafted is None) else None
        if drafted is not None:
            draft, sources = _beside(drafted, lookup)
        else:
            draft, sources = lookup, ["alone"] * (len(lookup) if lookup is not None else 0)
        self._last = (drafted, found, bucket, band, seq.shape[1], draft, sources)
        if draft is not None and self.trim and sampling.greedy:
            draft = self._trimmed(draft, sources, self._head_s or 0.0)
        self.rounds["both" if drafted is not None and lookup is not None else "head" if drafted is not None
                    else "lookup" if lookup is not None else "none"] += 1
        self._rows = 1 + (len(draft) if draft is not None else 0)
        return draft

    @staticmethod
    def _node_key(source: str, score: float, span: int) -> tuple[str, int, int]:
        """A node's calibration class: its source, its score's tenth and, for the lookup's nodes, the length class of
        the lookup's draft (a 16-token draft follows a 16-token match: at the same score a surer copy than a 2-token
        draft, and a trim that valued both alike cut extraction's long copies to 7 tokens where the lookup alone
        drafted 16)."""
        return source, _tenth(score), 0 if source == "head" else span

    def _node_value(self, source: str, score: float) -> float:
        """What the target accepted so far of the nodes of this source (SOURCES) and score tenth, shrunk towards the
        score itself."""
        accepted, n = self.node_calibration.get(self._node_key(source, score, self._span), (0.0, 0))
        return (accepted + SCORE_PRIOR * score) / (n + SCORE_PRIOR)

    def _trimmed(self, draft: Draft, sources: list[str], head_s: float) -> Optional[Draft]:
        """The nodes worth their rows: the n likeliest (each node valued by _node_value, and never above its parent:
        it is accepted only with it) for the n that maximises the tokens a round commits per second,
        (1 + their values' sum) / (this round's head time + a round's other time at 1 + n rows, as measured in this
        run: _row_seconds). n = 0: no draft (a plain step)."""
        if draft.scores is None or draft.prefix_hidden is not None or not self.row_seconds:
            return draft
        _, best_n, order = self._best(self._values(draft, sources), draft.depths(), head_s)
        if best_n == len(draft):
            return draft
        return draft.subset(sorted(order[:best_n])) if best_n else None

    def _values(self, draft: Draft, sources: list[str]) -> list[float]:
        """Each node's value (_node_value), never above its parent's."""
        value: list[float] = []
        for parent, source, score in zip(draft.parents, sources, draft.scores):
            v = self._node_value(source, score)
            value.append(v if parent < 0 else min(v, value[parent]))
        return value

    def _best(self, value: list[float], depths: list[int], head_s: float) -> tuple[float, int, list[int]]:
        """The most tokens a second a round can commit with the likeliest nodes of a draft (value, depths), the
        number of nodes that does it, and the nodes by likelihood (parents before children)."""
        order = sorted(range(len(value)), key=lambda i: (-value[i], depths[i], i))
        seconds = self._row_seconds(len(value) + 1)
        best, best_n, tokens = 1.0 / (head_s + seconds[1]), 0, 1.0
        for n, i in enumerate(order, 1):
            tokens += value[i]
            rate = tokens / (head_s + seconds[1 + n])
            if rate > best:
                best, best_n = rate, n
        return best, best_n, order

    def _keep_drafting(self, lookup: Optional[Draft], start: float, budget: int):
        """The head's chain asks after each token whether to draft another (greedy, trim): only while some number of
        further tokens, each at the chain's next confidence (its mean step probability so far in the run) valued as
        the trim values them, would raise the round's tokens a second, their steps' time (measured) included. A
        token past that point would be drafted only to be cut."""
        last: list[float] = []

        def keep(tokens: list[int], scores: list[float]) -> bool:
            now = time.perf_counter()
            if last:
                step = now - last[0]
                self.step_s = step if self.step_s is None else self.step_s + 0.2 * (step - self.step_s)
            last[:] = [now]
            if len(scores) > 1 and scores[-2] > 0:
                self.step_prob += 0.1 * (scores[-1] / scores[-2] - self.step_prob)
            if self.step_s is None:
                return True  # a step not yet timed: draft on, and time it
            chain = Draft.chain(list(tokens), scores=list(scores))
            draft, sources = _beside(chain, lookup)
            if draft.scores is None:
                return True  # a lookup without scores (n-gram): nothing to price, and the trim leaves it whole
            value, depths, spent = self._values(draft, sources), draft.depths(), now - start
            rate = self._best(value, depths, spent)[0]
            parent, score = len(chain) - 1, scores[-1]  # merge puts the chain's nodes first
            for m in range(1, budget - len(chain) + 1):
                score *= self.step_prob
                value.append(min(self._node_value("head", score), value[parent]))
                depths.append(len(chain) + m)
                parent = len(value) - 1
                if self._best(value, depths, spent + m * self.step_s)[0] > rate:
                    return True
            return False

        return keep

    def _row_seconds(self, most: int) -> list[float]:
        """A round's time outside the head at 0..most rows (by index): as measured, never above what more rows
        measured (a pass never costs less for more rows: one slow round of 4 rows must not price 4 rows above 10);
        rows not measured as the most rows measured below them, else (fewer rows than any measured: a head that drafts
        every round leaves one row unseen) as the fewest. One pass over the measured counts (the chain's stop asks
        this several times a step)."""
        floor, low = {}, float("inf")
        for rows in sorted(self.row_seconds, reverse=True):
            low = min(low, self.row_seconds[rows])
            floor[rows] = low
        at, seconds = min(floor), []
        for rows in range(most + 1):
            at = rows if rows in floor else at
            seconds.append(floor[at])
        return seconds

    def _time_round(self, sampling: Sampling) -> None:
        """A round runs from one propose to the next: the head's share of the last one, and the rest of it by the
        rows it verified, a median over that row count's latest rounds (greedy only: a sampled run must not depend on
        the clock, so that a seed repeats it)."""
        now = time.perf_counter()
        if self._round_start is not None and sampling.greedy:
            rest = now - self._round_start - (self._head_s or 0.0) - self._skip_s
            if self._head_s is not None and rest > 0:
                self.head_cost += 0.2 * (self._head_s / rest - self.head_cost)
            times = self._row_times.setdefault(self._rows, deque(maxlen=ROW_WINDOW))
            times.append(rest)
            self.row_seconds[self._rows] = statistics.median(times)  # a preempted round moves it one place
        self._round_start, self._head_s, self._skip_s = now, None, 0.0

    def _head_pays(self, band: int) -> bool:
        """The gate: whether the head drafts this round, by its gain in rounds of this band (the lookup's calibrated
        estimate) against its share of a round's time, or an exploring round (after ever more benched ones while it
        loses)."""
        if self.head_gain.get(band, PRIOR_GAIN) >= self.head_cost + HEAD_MARGIN:
            self._benched[band], self._explore[band] = 0, self.explore_every
            return True
        self._benched[band] = self._benched.get(band, 0) + 1
        if self._benched[band] < self._explore.get(band, self.explore_every) or not self._cheap_read():
            return False
        self._benched[band] = 0
        self._explore[band] = min(2 * self._explore.get(band, self.explore_every), MAX_EXPLORE)
        return True

    def _cheap_read(self) -> bool:
        """Whether an exploring round may draft now: its read of the positions the head has not read (at the rate of
        its latest batched read) costs at most 1/explore_read of the time since the head last read. After a long
        bench, or early in a request whose prompt it has not read, that read is what a try costs (a 365-token prompt:
        ~30 ms against a 20 ms round here), and a try that finds the head still benched wastes it."""
        pending = sum(f.shape[1] for f, _, _ in self._pending)
        if not self.explore_read or self._read_rate is None or not pending:
            return True
        return self._read_rate * pending * self.explore_read <= time.perf_counter() - self._read_at

    def _calibrated(self, bucket: int, own: float) -> float:
        """The lookup's accepted tokens at this estimate so far, shrunk towards its own estimate."""
        total, n = self.calibration.get(bucket, (0.0, 0))
        return (total + self.prior * own) / (n + self.prior)

    def _learn(self, seq: torch.Tensor, start: int) -> None:
        """After a verification pass: how many tokens of each draft the target's committed text bears out."""
        if self._last is None:
            return
        drafted, found_draft, bucket, band, L, draft, sources = self._last
        lookup = draft is not None and any(source != "head" for source in sources)  # the lookup's draft was verified
        committed = seq[0, L:].tolist()  # the tokens after the root that this pass committed
        # greedy: what the lookup's draft would have had accepted is its agreement with the committed text (a draft
        # the round left out included), as far as that text goes
        found = _matched(found_draft, committed) if found_draft is not None else 0
        if drafted is not None:
            matched = _matched(drafted, committed)
            self.head_mean += 0.1 * (matched - self.head_mean)
            gain = self.head_gain.get(band, PRIOR_GAIN)
            self.head_gain[band] = gain + 0.1 * (max(matched - found, 0) - gain)
        if lookup:
            stats = self.calibration.setdefault(bucket, [0.0, 0])
            stats[0] += found
            stats[1] += 1
        if draft is not None and draft.scores is not None:  # every node of the round's draft, trimmed or not
            span = _span(len(found_draft)) if found_draft is not None else 0  # as propose classed its nodes
            for node, accepted in _outcomes(draft, committed).items():
                key = self._node_key(sources[node], draft.scores[node], span)
                stats = self.node_calibration.setdefault(key, [0.0, 0])
                stats[0] += accepted
                stats[1] += 1
        self._last = None


def _band(expected: float) -> int:
    return sum(expected >= edge for edge in BANDS)


def _bucket(expected: float) -> int:
    return min(int(expected * 2), 40)  # half-token buckets


def _beside(drafted: Draft, lookup: Optional[Draft]) -> tuple[Draft, list[str]]:
    """The head's draft with the lookup's merged beside it (when there is one), and who proposed each node."""
    if lookup is None:
        return drafted, ["head"] * len(drafted)
    merged = merge(drafted, lookup)
    return merged, _sources(merged, len(drafted), lookup)


def _sources(merged: Draft, n_head: int, lookup: Draft) -> list[str]:
    """Who proposed each node of merge(head's draft, lookup): both (the same path), head or lookup."""
    theirs = set(_paths(lookup))
    return ["lookup" if i >= n_head else "both" if path in theirs else "head" for i, path in enumerate(_paths(merged))]


def _paths(draft: Draft) -> list[tuple[int, ...]]:
    """Each node's tokens from the root's child down to it."""
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(draft.tokens, draft.parents):
        paths.append((paths[parent] if parent >= 0 else ()) + (token,))
    return paths


def _span(length: int) -> int:
    """A lookup draft's length class: 1, 2-3, 4-7, 8-15, 16 or more nodes."""
    return min(max(length, 1).bit_length() - 1, 4)


def _tenth(score: float) -> int:
    return min(max(int(score * 10), 0), 9)


def _outcomes(draft: Draft, committed: list[int]) -> dict[int, bool]:
    """Greedy: whether the target accepted each node of `draft` (its path is where the committed text begins), for
    the nodes the committed text decides (a node deeper than it whose path it matches so far is left out)."""
    out: dict[int, bool] = {}
    for i, path in enumerate(_paths(draft)):
        if len(path) <= len(committed) or list(path[:len(committed)]) != committed:
            out[i] = list(path) == committed[:len(path)]
    return out


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
