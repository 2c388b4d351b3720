"""Hybrid drafting (decode/drafters/hybrid.py) through the engine: greedy output identical to the target's own in
every mode, the lookup's branch and the head's both accepted, and sampling distributed exactly as the target
(chi-square over seeds) when a SAMPLED head branch and a point-mass lookup branch share one verification tree."""

from __future__ import annotations


import pytest
import torch

from harness.drafters import OracleDrafter
from selfspec.decode.drafters.hybrid import HybridDrafter
from selfspec.decode.drafters.ngram import NgramDrafter
from selfspec.decode.drafters.suffix import SuffixDrafter
from selfspec.decode.engine import generate
from sampling_stats import chi_square_pvalue, exact_joint, sampled_first_three

NEW = 60


class _Counting:
    """A drafter wrapper that counts the tokens of its drafts the target then committed (greedy: accepted)."""

    def __init__(self, inner):
        self.inner, self.name, self.accepted = inner, inner.name, 0
        self.feature_layers = getattr(inner, "feature_layers", None)
        self.expected, self._last = 0.0, None

    def reset(self, ids):
        self.inner.reset(ids)

    def observe(self, seq, features, start):
        if self._last is not None:
            draft, L = self._last
            committed = seq[0, L:].tolist()
            n = 0
            while n < len(committed) and n < len(draft.tokens) and draft.tokens[n] == committed[n]:
                n += 1
            self.accepted += n
            self._last = None
        self.inner.observe(seq, features, start)

    def propose(self, seq, max_depth, sampling):
        d = self.inner.propose(seq, max_depth, sampling)
        self.expected = getattr(self.inner, "expected", 0.0)
        self._last = (d, seq.shape[1]) if d is not None and d.is_chain else None
        return d


@pytest.mark.parametrize("mode", ["auto", "tree", "choose"])
def test_greedy_identical_in_every_mode(mode, family, tiny_target, prompt_of, reference):
    target = tiny_target(family)
    ids = prompt_of(target)
    want = reference(family, ids, NEW)
    for head in (OracleDrafter(target.model, num_draft=3), OracleDrafter(target.model, num_draft=2, width=2),
                 OracleDrafter(target.model, num_draft=3, wrong=True)):
        for lookup in (SuffixDrafter(num_draft=6), SuffixDrafter(num_draft=6, tree=True), NgramDrafter(num_draft=4)):
            r = generate(target, HybridDrafter(head, lookup, mode=mode), ids, NEW, eos_token_ids=[])
            assert r.tokens == want, (mode, head.width, head.wrong, lookup.name)


def test_both_branches_get_accepted(tiny_target, prompt_of, reference):
    """A head that is always wrong at its first token beside a lookup on a text that repeats: every accepted token
    came through the lookup's branch; a right head beside it: the head's too."""
    target = tiny_target("llama")
    ids = prompt_of(target, "one two three one two three one two three")
    want = reference("llama", ids, NEW)
    head, lookup = _Counting(OracleDrafter(target.model, num_draft=3, wrong=True)), _Counting(SuffixDrafter())
    r = generate(target, HybridDrafter(head, lookup, mode="tree"), ids, NEW, eos_token_ids=[])
    assert r.tokens == want and head.accepted == 0 and lookup.accepted > 0
    head, lookup = _Counting(OracleDrafter(target.model, num_draft=3)), _Counting(SuffixDrafter())
    # the oracle drafts with the whole target, dearer than the pass it saves: without the gate it drafts every round
    r = generate(target, HybridDrafter(head, lookup, mode="tree", cost_gate=False), ids, NEW, eos_token_ids=[])
    assert r.tokens == want and head.accepted > 0 and r.tau > 3.0  # the oracle's chain of 3 is always accepted


class _Slow:
    """A drafter whose proposal takes `seconds` (a dear head, or the rest of a round beside a lookup: its `expected`
    is the inner lookup's)."""

    def __init__(self, inner, seconds: float):
        self.inner, self.seconds, self.name = inner, seconds, inner.name

    def reset(self, ids):
        self.inner.reset(ids)

    def observe(self, seq, features, start):
        self.inner.observe(seq, features, start)

    def propose(self, seq, max_depth, sampling):
        import time

        time.sleep(self.seconds)
        return self.inner.propose(seq, max_depth, sampling)

    @property
    def expected(self) -> float:
        return self.inner.expected


def test_a_head_that_does_not_pay_is_left_out_and_one_that_does_is_kept(tiny_target, prompt_of, reference):
    """Greedy: a dear head that is never right drafts only in the gate's exploring rounds; a cheap one that is always
    right drafts in nearly every round. Output identical either way."""
    target = tiny_target("llama")
    ids = prompt_of(target)
    want = reference("llama", ids, NEW)
    dear = HybridDrafter(_Slow(OracleDrafter(target.model, num_draft=3, wrong=True), 0.05), SuffixDrafter())
    r = generate(target, dear, ids, NEW, eos_token_ids=[])
    used = dear.rounds["head"] + dear.rounds["both"]
    assert r.tokens == want and used <= 2 + r.verify_passes // dear.explore_every
    good = HybridDrafter(_Answer(ids + want), SuffixDrafter(), mode="tree")
    r = generate(target, good, ids, NEW, eos_token_ids=[])
    assert r.tokens == want and good.rounds["head"] + good.rounds["both"] >= r.verify_passes - 1


class _Answer:
    """A head that knows the answer: the next 3 tokens of `text`, at no cost."""

    name, n = "answer", 3

    def __init__(self, text):
        self.text = text

    def reset(self, ids):
        pass

    def observe(self, seq, features, start):
        pass

    def propose(self, seq, max_depth, sampling):
        from selfspec.decode.draft import Draft

        L = seq.shape[1]
        return Draft.chain(self.text[L:L + min(self.n, max_depth)]) if L < len(self.text) else None


class _AnswerLookup(_Answer):
    """A lookup that knows the answer too (its next token), sure of it (`expected`): a head's first token beside it
    is no gain."""

    name, n, expected = "answer-lookup", 1, 3.0


def test_a_head_right_only_where_the_lookup_is_right_too_is_benched_and_explored_ever_less(tiny_target, prompt_of,
                                                                                          reference):
    """The gate weighs what the head adds beyond the lookup's accepted tokens, not its own: a dear head always right
    beside a lookup always right with the same tokens gains nothing, so after its first rounds it drafts only in
    exploring rounds, after 8, 16, 32, 64, 64, ... benched ones (each exploration that finds no gain doubles the wait).
    Output identical."""
    from selfspec.decode.drafters.hybrid import MAX_EXPLORE

    target = tiny_target("llama")
    ids = prompt_of(target)
    want = reference("llama", ids, 240)
    head = _Answer(ids + want)
    head.n = 1
    hybrid = HybridDrafter(_Slow(head, 0.05), _AnswerLookup(ids + want), mode="tree")
    r = generate(target, hybrid, ids, 240, eos_token_ids=[])
    used, rounds = hybrid.rounds["head"] + hybrid.rounds["both"], sum(hybrid.rounds.values())
    waits, gap = [], hybrid.explore_every
    while sum(waits) + gap <= rounds:
        waits.append(gap)
        gap = min(2 * gap, MAX_EXPLORE)
    assert r.tokens == want and all(g < hybrid.head_mean for band, g in hybrid.head_gain.items() if band >= 0)
    assert 1 <= used <= 4 + len(waits), (used, rounds)
    assert used < rounds // hybrid.explore_every / 2, (used, rounds)  # half what a fixed interval would spend


class _SureOrUnsure(_Answer):
    """A lookup right and sure (its 3 tokens, expecting 3) in alternate blocks of `block` positions, wrong and unsure
    (expecting 0.4) in the others."""

    name = "sure-or-unsure"

    def __init__(self, text, block):
        super().__init__(text)
        self.block, self.expected = block, 0.0

    def sure(self, L: int) -> bool:
        return (L // self.block) % 2 == 0

    def propose(self, seq, max_depth, sampling):
        from selfspec.decode.draft import Draft

        L = seq.shape[1]
        if L >= len(self.text):
            return None
        self.expected = 3.0 if self.sure(L) else 0.4
        return Draft.chain(self.text[L:L + min(self.n, max_depth)] if self.sure(L) else [self.text[L] + 1])


class _Positions(_Answer):
    """The answer head, recording the sequence length at each of its drafts."""

    def __init__(self, text):
        super().__init__(text)
        self.at = []

    def propose(self, seq, max_depth, sampling):
        self.at.append(seq.shape[1])
        return super().propose(seq, max_depth, sampling)


def _drafted_per_block(head, lookup, ids, n):
    """The head's drafts beside the sure and the unsure lookup ({True: sure, False: unsure}), and the rounds each kind
    of block holds when every sure round commits the lookup's 3 tokens + the bonus and every unsure one (with the
    head) the head's 3 + 1."""
    sure = [L for L in range(len(ids), len(ids) + n) if lookup.sure(L)]
    rounds = {True: len(sure) // 4, False: (n - len(sure)) // 4}
    drafted = {k: sum(lookup.sure(L) == k for L in head.at) for k in (True, False)}
    return drafted, rounds


def test_the_gate_weighs_the_head_per_band_of_the_lookups_confidence(tiny_target, prompt_of, reference):
    """A free head always right beside a lookup that is, in alternate blocks, sure and right with the same tokens or
    unsure and wrong: the head adds nothing beside the sure lookup and is benched there once its gain has decayed
    (exploring rounds after that), but drafts in every round beside the unsure one. One gain for every round with a
    lookup draft would mix the two and draft in both."""
    target = tiny_target("llama")
    ids = prompt_of(target)
    want = reference("llama", ids, 440)
    head = _Positions(ids + want)
    lookup = _SureOrUnsure(ids + want, 40)
    hybrid = HybridDrafter(head, lookup)
    r = generate(target, hybrid, ids, 440, eos_token_ids=[])
    assert r.tokens == want
    drafted, rounds = _drafted_per_block(head, lookup, ids, 440)
    assert drafted[False] >= rounds[False] - 2, (drafted, rounds)
    # ~28 rounds for a gain of 1 (PRIOR_GAIN) to decay under 0.05, then exploring rounds only
    assert drafted[True] <= 28 + 3 < rounds[True] - 20, (drafted, rounds)


class _ReadsSlowly(_Positions):
    """The answer head, reading the target's features at `seconds` a position (a head's fusion and decoder layer)."""

    def __init__(self, text, seconds: float):
        super().__init__(text)
        self.seconds = seconds

    def observe(self, seq, features, start):
        import time

        time.sleep(self.seconds * features.shape[1])


def test_reading_the_positions_of_benched_rounds_is_not_charged_to_the_head(tiny_target, prompt_of, reference):
    """A head always right that reads the target's features at 5 ms a position, beside a lookup taking 10 ms a round
    that is, in alternate blocks, sure and right (the head benched: it gains nothing there) or unsure and wrong (the
    head pays: 3 tokens for ~2 rounds' worth of time). Its first round reads the prompt's ~70 positions, and each unsure
    block opens with it reading the ~40 positions of the sure block it sat out (~0.2 s, twenty times the rest of the
    round): one-offs of starting and resuming, not what its rounds cost, so the head keeps drafting in every unsure
    round. Charged to the head's share, such reads bench it in the unsure blocks too (6 of 53 rounds drafted)."""
    target = tiny_target("llama")
    ids = prompt_of(target)
    want = reference("llama", ids, 440)
    head = _ReadsSlowly(ids + want, 0.005)
    lookup = _SureOrUnsure(ids + want, 40)
    hybrid = HybridDrafter(head, _Slow(lookup, 0.01))
    r = generate(target, hybrid, ids, 440, eos_token_ids=[])
    assert r.tokens == want
    drafted, rounds = _drafted_per_block(head, lookup, ids, 440)
    assert drafted[True] < rounds[True] - 20, (drafted, rounds)  # benched beside the sure lookup: positions pile up
    assert drafted[False] >= rounds[False] - 2, (drafted, rounds)
    assert hybrid.head_cost < 2.95, hybrid.head_cost  # its rounds' share: under the 3 tokens it adds


T, TOP_K, RUNS = 1.0, 3, 400


@pytest.mark.parametrize("mode", ["tree", "auto"])
def test_sampling_with_a_sampled_head_branch_beside_a_lookup_is_exact(mode, tiny_target, prompt_of):
    """The head's children drawn from its own rows (the oracle, sampled at a sharper temperature: p != q), the
    lookup's fixed (point masses), siblings under one root: the first three tokens follow the target's joint."""
    target = tiny_target("llama")
    vocab = target.model.get_output_embeddings().weight.shape[0]
    prompt = list(range(vocab))  # every token occurred before, followed by another: the lookup drafts at every step
    torch.manual_seed(0)
    head = OracleDrafter(target.model, num_draft=2, sampled=True)
    lookup = SuffixDrafter(num_draft=3, min_prob=0.0)
    drafter = HybridDrafter(head, lookup, mode=mode)
    counts, accepted = sampled_first_three(target, drafter, prompt, RUNS, T, TOP_K)
    assert chi_square_pvalue(counts, exact_joint(target.model, prompt, T, TOP_K), RUNS) > 1e-3
    # drafts really accepted (and rejected: p != q); auto often lets the lookup draft alone, rarely accepted at T=1
    assert accepted > (RUNS // 4 if mode == "tree" else RUNS // 20)
    assert drafter.rounds["lookup"] + drafter.rounds["both"] > 0 and drafter.rounds["head"] + drafter.rounds["both"] > 0


# --------------------------------------------------------------------------------------------- the trim
class _Scored:
    """A drafter wrapper whose drafts carry node scores (Draft.scores): `scores` per depth, each node's path."""

    def __init__(self, inner, scores):
        self.inner, self.scores, self.name = inner, scores, inner.name
        self.expected = 0.0

    def reset(self, ids):
        self.inner.reset(ids)

    def observe(self, seq, features, start):
        self.inner.observe(seq, features, start)

    def propose(self, seq, max_depth, sampling):
        import dataclasses

        d = self.inner.propose(seq, max_depth, sampling)
        self.expected = getattr(self.inner, "expected", 0.0)
        return None if d is None else dataclasses.replace(d, scores=[self.scores[k - 1] for k in d.depths()])


class _FixedCosts(dict):
    """A round's seconds by rows that the run does not change (the test's, not the clock's)."""

    def __init__(self, costs):
        super().__init__(costs)
        self.frozen = True

    def __setitem__(self, key, value):
        if not getattr(self, "frozen", False):
            super().__setitem__(key, value)


def _hybrid(costs=None, **kw):
    h = HybridDrafter(_Answer([]), _AnswerLookup([]), **kw)
    if costs is not None:
        h.row_seconds = _FixedCosts(costs)
    return h


def test_the_trim_keeps_the_nodes_that_pay_for_their_rows():
    """A pass dearer from 4 rows: a chain of 6 whose third token is unsure is cut to 2 tokens; where every row costs
    alike, kept whole; an unlikely draft beside a dear second row is dropped (a plain step); nodes are taken by
    score across the branches of a tree, parents before children."""
    from selfspec.decode.draft import Draft

    chain = Draft.chain([11, 12, 13, 14, 15, 16], scores=[0.9, 0.8, 0.3, 0.2, 0.1, 0.05])
    cliff = _hybrid({1: 0.060, 3: 0.065, 4: 0.090})
    heads = ["head"] * 6
    cut = cliff._trimmed(chain, heads, 0.0)
    assert cut.tokens == [11, 12] and cut.is_chain and cut.scores == [0.9, 0.8]
    assert _hybrid({1: 0.060})._trimmed(chain, heads, 0.0) is chain  # no row costs more: nothing to cut
    # a head that drafts every round leaves a plain step's row count unmeasured: fewer rows cost as the fewest seen
    assert _hybrid({3: 0.065, 4: 0.090})._trimmed(chain, heads, 0.0).tokens == [11, 12]
    assert _hybrid({1: 0.060, 2: 0.080})._trimmed(Draft.chain([11], scores=[0.05]), ["head"], 0.0) is None
    # the head's time this round is sunk, and counts in both: a dear head makes the extra rows relatively cheaper
    assert cliff._trimmed(chain, heads, 1.0) is chain
    tree = Draft([11, 21, 12, 22, 13], [-1, -1, 0, 1, 2], scores=[0.9, 0.5, 0.8, 0.45, 0.1])
    kept = _hybrid({1: 0.060, 5: 0.061, 6: 0.2})._trimmed(tree, ["head"] * 5, 0.0)
    assert kept.tokens == [11, 21, 12, 22] and kept.parents == [-1, -1, 0, 1]
    # valued by what was accepted: a lookup's sure nodes the target rejected are cut, a child never above its parent
    lookup = Draft.chain([31, 32, 33], scores=[1.0, 1.0, 0.5])
    doubted = _hybrid({1: 0.060, 2: 0.065, 4: 0.090})
    doubted.node_calibration[("alone", 9, 0)] = [0.0, 96]  # 1.0 -> 4 / 100 (a 1-node lookup draft's class)
    assert doubted._trimmed(lookup, ["alone"] * 3, 0.0) is None  # 0.5 would be worth its row, but not beyond its parent


def test_the_trim_values_nodes_by_what_the_target_accepted_of_that_score():
    """Which nodes the committed text decides, and a node's value: what was accepted of its source and score tenth,
    shrunk towards the score; who proposed each node of a merged draft."""
    from selfspec.decode.draft import Draft, merge
    from selfspec.decode.drafters.hybrid import _outcomes, _sources, _span

    chain = Draft.chain([1, 2, 3])
    assert _outcomes(chain, [1, 2]) == {0: True, 1: True}  # node 3: the committed text does not reach it
    assert _outcomes(chain, [1, 5]) == {0: True, 1: False, 2: False}
    head, lookup = Draft.chain([1, 2, 3]), Draft([1, 7, 8], [-1, 0, -1])
    merged = merge(head, lookup)
    assert merged.tokens == [1, 2, 3, 7, 8] and _sources(merged, 3, lookup) == ["both", "head", "head", "lookup",
                                                                                 "lookup"]
    h = _hybrid()
    h.node_calibration[("lookup", 9, 0)] = [1.0, 20]
    assert h._node_value("lookup", 0.95) == pytest.approx((1.0 + 4 * 0.95) / 24)
    assert h._node_value("head", 0.95) == pytest.approx(0.95)  # no evidence: its own score
    # a lookup's nodes are calibrated apart by the length of its draft (a long draft follows a long match)
    assert [_span(n) for n in (1, 2, 3, 4, 7, 8, 15, 16, 40)] == [0, 1, 1, 2, 2, 3, 3, 4, 4]
    h._span = _span(16)
    assert h._node_value("lookup", 0.95) == pytest.approx(0.95)  # a 16-node draft's class: no evidence yet
    h.node_calibration[("lookup", 9, 4)] = [20.0, 20]
    assert h._node_value("lookup", 0.95) == pytest.approx((20.0 + 4 * 0.95) / 24)
    h.node_calibration[("head", 9, 0)] = [0.0, 20]
    assert h._node_value("head", 0.95) == pytest.approx(4 * 0.95 / 24)  # the head's nodes: one class whatever the span


def test_greedy_identical_with_the_trim_cutting(family, tiny_target, prompt_of, reference):
    """Each row dearer, scored head and lookup drafts (the head sure of its first token, which is never the
    target's): the trim cuts drafts, the output is the target's own."""
    target = tiny_target(family)
    ids = prompt_of(target, "one two three one two three one two three")
    want = reference(family, ids, NEW)
    head = _Scored(OracleDrafter(target.model, num_draft=4, wrong=True), [0.9, 0.6, 0.3, 0.1])  # sure, and wrong
    hybrid = HybridDrafter(head, SuffixDrafter(num_draft=8), mode="tree", cost_gate=False)
    hybrid.row_seconds = _FixedCosts({rows: 0.05 + 0.02 * (rows - 1) for rows in range(1, 20)})
    cut = []
    trimmed = hybrid._trimmed
    hybrid._trimmed = lambda d, src, s: (lambda t: cut.append(t is None or len(t) < len(d)) or t)(trimmed(d, src, s))
    r = generate(target, hybrid, ids, NEW, eos_token_ids=[])
    assert r.tokens == want and any(cut)
    hybrid.trim = False
    whole = generate(target, hybrid, ids, NEW, eos_token_ids=[])
    assert whole.tokens == want and r.drafted_tokens / r.verify_passes < whole.drafted_tokens / whole.verify_passes


def test_a_rounds_time_per_row_count_is_the_median_of_its_latest_rounds_and_never_above_more_rows(monkeypatch):
    """One slow round of 4 rows (a preempted pass) moves its time one place, not a fifth of the way to the spike; a
    row count priced above a larger one (few rounds, all slow) costs what the larger one does."""
    from selfspec.decode.draft import Sampling
    from selfspec.decode.drafters import hybrid as hybrid_module

    clock = [0.0]
    monkeypatch.setattr(hybrid_module.time, "perf_counter", lambda: clock[0])
    h = _hybrid()
    for rows, seconds in [(4, 0.10)] * 4 + [(4, 0.60)] + [(3, 0.08)] * 3:
        h._rows = rows
        h._time_round(Sampling())
        clock[0] += seconds
    h._time_round(Sampling())
    assert h.row_seconds[4] == pytest.approx(0.10) and h.row_seconds[3] == pytest.approx(0.08)
    seconds = _hybrid({1: 0.07, 3: 0.08, 4: 0.19, 10: 0.11})._row_seconds(12)
    assert [seconds[rows] for rows in (1, 2, 3, 4, 7, 10, 12)] == pytest.approx(
        [0.07, 0.07, 0.08, 0.11, 0.11, 0.11, 0.11])


def test_a_chain_head_stops_where_its_next_tokens_would_be_cut():
    """Before each further step a chain head asks the hybrid (greedy, trim): with a pass dearer from 4 rows, a sure
    second token is worth its step, a third is not, unless steps and rows are cheap; a step not yet timed is taken."""
    import time as clock

    from selfspec.decode.draft import Draft

    costs = {1: 0.060, 3: 0.065, 4: 0.090, 6: 0.2}
    h = _hybrid(costs)
    assert h._keep_drafting(None, clock.perf_counter(), 6)([11], [0.9])  # not timed yet
    h.step_s = 0.004
    keep = h._keep_drafting(None, clock.perf_counter(), 6)
    assert keep([11], [0.9]) and not keep([11, 12], [0.9, 0.8])
    flat = _hybrid({1: 0.060, 8: 0.061})
    flat.step_s = 0.0001
    assert flat._keep_drafting(None, clock.perf_counter(), 6)([11, 12], [0.9, 0.8])
    # beside a lookup's two sure tokens on another branch, the head's second token would be a fourth row
    lookup = Draft.chain([31, 32], scores=[0.95, 0.9])
    h.step_s = 0.004
    assert not h._keep_drafting(lookup, clock.perf_counter(), 6)([11], [0.5])
    # an n-gram lookup scores nothing: nothing to price, so the chain goes on (the trim leaves such a draft whole)
    assert h._keep_drafting(Draft.chain([31, 32]), clock.perf_counter(), 6)([11], [0.5])


def test_greedy_identical_with_a_chain_head_stopped_by_the_hybrid(family, tiny_target, prompt_of, reference):
    """A tiny EAGLE head's chains, stopped where the hybrid finds their next tokens would be cut (a dear fourth row,
    cheap steps): the output is the target's own, and the head was stopped."""
    from selfspec.decode.drafters import build_drafter
    from selfspec.methods.eagle.head import build_eagle

    target = tiny_target(family)
    ids = prompt_of(target, "one two three one two three one two three")
    want = reference(family, ids, NEW)
    hybrid = build_drafter("hybrid", target, head=build_eagle(target.model), hybrid_num_draft=5,
                           hybrid_min_confidence=0.0, hybrid_mode="tree", lookup_num_draft=4)
    hybrid.cost_gate = False
    hybrid.row_seconds = _FixedCosts({rows: 0.05 + (0.03 if rows > 3 else 0.0) for rows in range(1, 20)})
    hybrid.step_s = 0.0
    asked = []
    keep_drafting = hybrid._keep_drafting

    def spy(lookup, start, budget):
        keep = keep_drafting(lookup, start, budget)
        return lambda tokens, scores: (lambda answer: asked.append(answer) or answer)(keep(tokens, scores))

    hybrid._keep_drafting = spy
    r = generate(target, hybrid, ids, NEW, eos_token_ids=[])
    assert r.tokens == want and False in asked
    assert hybrid.head.keep_drafting is None  # set for the head's propose only


def test_a_chain_heads_leaves_beside_its_first_tokens(family, tiny_target, prompt_of, reference):
    """An EAGLE chain with siblings: greedy, beside each of its first `sibling_depth` tokens its next likeliest
    tokens as leaves, each scored by its path's probability under the head (never above its parent's); sampling
    keeps the plain chain. In a hybrid (trim off) the leaves reach the verification pass and the output is the
    target's own."""
    from selfspec.decode.draft import Sampling
    from selfspec.decode.drafters import build_drafter
    from selfspec.methods.eagle.drafter import EagleDrafter
    from selfspec.methods.eagle.head import build_eagle

    target = tiny_target(family)
    ids = prompt_of(target, "one two three one two three one two three")
    seq = torch.tensor([ids])
    head = build_eagle(target.model)
    drafter = EagleDrafter(head, target.model.get_output_embeddings().weight.shape[0], num_draft=4, siblings=2,
                           sibling_depth=2)
    with torch.no_grad():
        h = target.model(seq, output_hidden_states=True).hidden_states[-1][:, :-1]  # f_t beside x_{t+1}
    drafter.observe(seq, h, 0)
    with torch.no_grad():  # as generate drafts (under torch.inference_mode)
        draft = drafter.propose(seq, 4, Sampling())
    assert draft.parents == [-1, 0, 1, 2, -1, -1, 0, 0]
    assert len({draft.tokens[i] for i in (0, 4, 5)}) == 3 and len({draft.tokens[i] for i in (1, 6, 7)}) == 3
    assert all(draft.scores[i] <= (1.0 if p < 0 else draft.scores[p]) for i, p in enumerate(draft.parents))
    assert draft.scores[4] >= draft.scores[5] and draft.scores[0] + draft.scores[4] + draft.scores[5] <= 1 + 1e-6
    drafter.reset(seq)
    drafter.observe(seq, h, 0)
    with torch.no_grad():
        sampled = drafter.propose(seq, 4, Sampling(temperature=1.0, generator=torch.Generator().manual_seed(0)))
    assert sampled.is_chain and len(sampled) == 4

    want = reference(family, ids, NEW)
    hybrid = build_drafter("hybrid", target, head=head, hybrid_num_draft=3, hybrid_min_confidence=0.0,
                           hybrid_mode="tree", lookup_num_draft=4, hybrid_siblings=2, hybrid_sibling_depth=2)
    hybrid.cost_gate, hybrid.trim = False, False
    assert (hybrid.head.siblings, hybrid.head.sibling_depth) == (2, 2)
    r = generate(target, hybrid, ids, NEW, eos_token_ids=[])
    assert r.tokens == want
    chain_only = build_drafter("hybrid", target, head=head, hybrid_num_draft=3, hybrid_min_confidence=0.0,
                               hybrid_mode="tree", lookup_num_draft=4)
    chain_only.cost_gate, chain_only.trim = False, False
    plain = generate(target, chain_only, ids, NEW, eos_token_ids=[])
    assert plain.tokens == want and r.drafted_tokens > plain.drafted_tokens  # the leaves were verified too
