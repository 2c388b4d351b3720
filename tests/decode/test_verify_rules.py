"""The acceptance rules, checked exactly: output distributions are computed in closed form by enumerating
every branch of the rules' randomness (no sampling), and must equal the target's distribution to 1e-9."""

from __future__ import annotations

from collections import defaultdict
from itertools import product

import pytest
import torch

from selfspec.decode.verify import greedy_chain, greedy_tree, probs, sample_chain, sample_tree

V = 5


# ------------------------------------------------------------------------------ exhaustive enumeration


class _Branch(Exception):
    def __init__(self, options):
        self.options = options


class ScriptedRng:
    """Replays a script of earlier choices; at the first new decision raises _Branch with every option."""

    def __init__(self, script):
        self.script, self.i, self.weight = script, 0, 1.0

    def _choose(self, options):
        options = [(v, w) for v, w in options if w > 0]
        if self.i < len(self.script):
            v = self.script[self.i]
            self.i += 1
            self.weight *= dict(options)[v]
            return v
        raise _Branch(options)

    def accept(self, prob: float) -> bool:
        prob = min(max(prob, 0.0), 1.0)
        return self._choose([(True, prob), (False, 1.0 - prob)])

    def draw(self, dist: torch.Tensor) -> int:
        return self._choose([(i, float(w)) for i, w in enumerate(dist.tolist())])


def enumerate_outcomes(fn) -> dict:
    """fn(rng) -> hashable outcome; -> {outcome: exact probability}."""
    out: dict = defaultdict(float)
    stack = [[]]
    while stack:
        script = stack.pop()
        rng = ScriptedRng(script)
        try:
            res = fn(rng)
        except _Branch as b:
            stack.extend(script + [v] for v, _ in b.options)
            continue
        out[res] += rng.weight
    return out


def random_dist(gen, *shape, zeros=True):
    """Random distributions over the last dim, with some exact zeros (never all)."""
    x = torch.rand(*shape, V, generator=gen, dtype=torch.float64)
    if zeros:
        x = x * (torch.rand(*shape, V, generator=gen, dtype=torch.float64) > 0.35)
        x[..., 0] += (x.sum(-1) == 0).to(x.dtype)
    return x / x.sum(-1, keepdim=True)


def assert_close(got: dict, want: dict, tol=1e-9):
    keys = set(got) | set(want)
    worst = max(abs(got.get(k, 0.0) - want.get(k, 0.0)) for k in keys)
    assert worst < tol, f"max deviation {worst}"


# ------------------------------------------------------------------------------------------------ greedy


def test_greedy_chain():
    assert greedy_chain([3, 4, 5], [3, 4, 5, 6]) == (3, 6)  # all accepted + bonus
    assert greedy_chain([3, 9, 5], [3, 4, 5, 6]) == (1, 4)  # correction at the first mismatch
    assert greedy_chain([9], [3, 4]) == (0, 3)
    assert greedy_chain([], [7]) == (0, 7)


def test_greedy_tree_follows_the_matching_branch():
    # root -> {1: a, 2: b}; 2 -> {3: c, 4: d}; 4 -> {5: e}
    tokens = [-1, 10, 11, 12, 13, 14]
    children = [[1, 2], [], [3, 4], [], [5], []]
    argmax = [11, 0, 13, 0, 14, 15]  # target after each node
    assert greedy_tree(tokens, children, argmax) == ([2, 4, 5], 15)
    argmax = [11, 0, 99, 0, 14, 15]
    assert greedy_tree(tokens, children, argmax) == ([2], 99)
    assert greedy_tree(tokens, children, [42] * 6) == ([], 42)


# ------------------------------------------------------------------------------------- sampling: chains


@pytest.mark.parametrize("seed", range(6))
def test_sample_chain_two_positions_is_exactly_q(seed):
    """Drafts d1 ~ p0, d2 ~ p1[d1]; the first two committed tokens must be distributed q0(a) q1[a](b)."""
    g = torch.Generator().manual_seed(seed)
    p0, p1 = random_dist(g), random_dist(g, V)
    q0, q1, q2 = random_dist(g), random_dist(g, V), random_dist(g, V, V)
    got: dict = defaultdict(float)
    for d1, d2 in product(range(V), range(V)):
        w = float(p0[d1] * p1[d1, d2])
        if w == 0:
            continue
        q = torch.stack([q0, q1[d1], q2[d1, d2]])
        p = torch.stack([p0, p1[d1]])
        for (n, nxt), pr in enumerate_outcomes(lambda rng: sample_chain([d1, d2], q, p, rng)).items():
            if n == 0:  # t2 comes from the next pass; sampling from q there is exact by itself
                for b in range(V):
                    got[(nxt, b)] += w * pr * float(q1[nxt, b])
            else:
                got[(d1, nxt if n == 1 else d2)] += w * pr
    want = {(a, b): float(q0[a] * q1[a, b]) for a in range(V) for b in range(V)}
    assert_close(got, want)


@pytest.mark.parametrize("seed", range(4))
def test_sample_chain_independent_block_positions_is_exactly_q(seed):
    """A DFlash block: d1 ~ p0, d2 ~ p1, d3 ~ p2 drawn INDEPENDENTLY (no position sees another's token), each with
    its own row passed as p. The first three committed tokens must be distributed q0(a) q1[a](b) q2[a, b](c)."""
    g = torch.Generator().manual_seed(seed)
    p = random_dist(g, 3)  # [3, V]: one row per block position, whatever was drafted before it
    q0, q1, q2, q3 = random_dist(g), random_dist(g, V), random_dist(g, V, V), random_dist(g, V, V, V)
    got: dict = defaultdict(float)
    for d in product(range(V), repeat=3):
        w = float(p[0, d[0]] * p[1, d[1]] * p[2, d[2]])
        if w == 0:
            continue
        q = torch.stack([q0, q1[d[0]], q2[d[0], d[1]], q3[d]])
        for (n, nxt), pr in enumerate_outcomes(lambda rng: sample_chain(list(d), q, p, rng)).items():
            head = list(d[:n]) + [nxt]  # committed by this pass; later ones come from q in the next passes
            if len(head) == 1:
                for b, c in product(range(V), repeat=2):
                    got[(head[0], b, c)] += w * pr * float(q1[head[0], b] * q2[head[0], b, c])
            elif len(head) == 2:
                for c in range(V):
                    got[(*head, c)] += w * pr * float(q2[head[0], head[1], c])
            else:
                got[tuple(head[:3])] += w * pr
    want = {(a, b, c): float(q0[a] * q1[a, b] * q2[a, b, c]) for a, b, c in product(range(V), repeat=3)}
    assert_close(got, want)


@pytest.mark.parametrize("seed", range(4))
def test_sample_chain_point_mass_draft_is_exactly_q(seed):
    """Deterministic drafts (p = None: prompt lookup, greedy drafters): any fixed draft leaves q intact."""
    g = torch.Generator().manual_seed(seed)
    q0, q1 = random_dist(g), random_dist(g, V)
    for d1 in range(V):  # including tokens with q0 = 0
        q = torch.stack([q0, q1[d1]])
        got: dict = defaultdict(float)
        for (n, nxt), pr in enumerate_outcomes(lambda rng: sample_chain([d1], q, None, rng)).items():
            got[d1 if n else nxt] += pr
        assert_close(got, {a: float(q0[a]) for a in range(V)})


# -------------------------------------------------------------------------------------- sampling: trees


def _first_two(path, nxt, tokens, q1):
    """Distribution of the first two committed tokens of one tree outcome (completing with q1 if needed)."""
    if not path:
        return {(nxt, b): float(q1[nxt, b]) for b in range(V)}
    if len(path) == 1:
        return {(tokens[path[0]], nxt): 1.0}
    return {(tokens[path[0]], tokens[path[1]]): 1.0}


@pytest.mark.parametrize("seed", range(4))
def test_sample_tree_point_masses_is_exactly_q(seed):
    """Top-k style trees (children fixed, distinct, p = None): root -> 3 children, each with 2 children."""
    g = torch.Generator().manual_seed(seed)
    q0, q1, q2 = random_dist(g), random_dist(g, V), random_dist(g, V, V)
    first = torch.randperm(V, generator=g)[:3].tolist()
    tokens, children, rows = [-1], [[]], [q0]
    for a in first:
        tokens.append(a)
        children[0].append(len(tokens) - 1)
        children.append([])
        rows.append(q1[a])
    for i, a in enumerate(first, start=1):
        for b in torch.randperm(V, generator=g)[:2].tolist():
            tokens.append(b)
            children[i].append(len(tokens) - 1)
            children.append([])
            rows.append(q2[a, b])
    q = torch.stack(rows)
    got: dict = defaultdict(float)
    for (path, nxt), pr in enumerate_outcomes(
            lambda rng: (lambda r: (tuple(r[0]), r[1]))(sample_tree(tokens, children, q, None, rng))).items():
        for k, v in _first_two(list(path), nxt, tokens, q1).items():
            got[k] += pr * v
    assert_close(got, {(a, b): float(q0[a] * q1[a, b]) for a in range(V) for b in range(V)})


@pytest.mark.parametrize("seed", range(3))
def test_sample_tree_iid_siblings_is_exactly_q(seed):
    """SpecInfer-style trees: the root's 2 children drawn i.i.d. from p0, each child's 2 children i.i.d. from
    p1[child]; multi-draft recursive rejection must still give q0(a) q1[a](b)."""
    g = torch.Generator().manual_seed(seed)
    p0, p1 = random_dist(g), random_dist(g, V)
    q0, q1, q2 = random_dist(g), random_dist(g, V), random_dist(g, V, V)
    got: dict = defaultdict(float)
    for x1, x2 in product(range(V), repeat=2):
        for y in product(range(V), repeat=4):  # children of x1: y0, y1; of x2: y2, y3
            w = float(p0[x1] * p0[x2] * p1[x1, y[0]] * p1[x1, y[1]] * p1[x2, y[2]] * p1[x2, y[3]])
            if w == 0:
                continue
            tokens = [-1, x1, x2, y[0], y[1], y[2], y[3]]
            children = [[1, 2], [3, 4], [5, 6], [], [], [], []]
            q = torch.stack([q0, q1[x1], q1[x2], q2[x1, y[0]], q2[x1, y[1]], q2[x2, y[2]], q2[x2, y[3]]])
            p = torch.stack([p0, p0, p0, p1[x1], p1[x1], p1[x2], p1[x2]])  # row c: what node c was drawn from
            outcomes = enumerate_outcomes(
                lambda rng: (lambda r: (tuple(r[0]), r[1]))(sample_tree(tokens, children, q, p, rng)))
            for (path, nxt), pr in outcomes.items():
                for k, v in _first_two(list(path), nxt, tokens, q1).items():
                    got[k] += w * pr * v
    assert_close(got, {(a, b): float(q0[a] * q1[a, b]) for a in range(V) for b in range(V)})


# ------------------------------------------------------------------------------------- logits processing


def test_probs_matches_hf_warpers():
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g) * 3
    for t, k, p in [(1.0, 0, 1.0), (0.7, 10, 1.0), (1.3, 0, 0.8), (0.9, 20, 0.6)]:
        x = TemperatureLogitsWarper(t)(None, logits.clone())
        if k:
            x = TopKLogitsWarper(k)(None, x)
        if p < 1:
            x = TopPLogitsWarper(p)(None, x)
        torch.testing.assert_close(probs(logits, t, k, p), x.softmax(-1))
    greedy = probs(logits, 0.0)
    assert torch.equal(greedy.argmax(-1), logits.argmax(-1)) and torch.equal(greedy.sum(-1), torch.ones(4))


# ------------------------------------------------------------------------- sampling: hybrid (mixed) trees


@pytest.mark.parametrize("seed", range(4))
def test_sample_tree_head_chain_beside_a_lookup_chain_is_exactly_q(seed):
    """A hybrid draft (decode.draft.merge): a head's sampled chain x1 ~ p0, x2 ~ p1[x1] beside a lookup's fixed
    chain (y1, y2), one root; merge gives the lookup's nodes point-mass rows. Every (x1, x2) and every lookup chain,
    duplicates of the head's tokens included: the first two committed tokens must be distributed q0(a) q1[a](b)."""
    from selfspec.decode.draft import Draft, merge

    g = torch.Generator().manual_seed(seed)
    p0, p1 = random_dist(g), random_dist(g, V)
    q0, q1, q2 = random_dist(g), random_dist(g, V), random_dist(g, V, V)
    lookups = [(int(a), int(b)) for a, b in torch.randint(0, V, (3, 2), generator=g).tolist()]
    for y in lookups:
        got: dict = defaultdict(float)
        for x1, x2 in product(range(V), repeat=2):
            w = float(p0[x1] * p1[x1, x2])
            if w == 0:
                continue
            draft = merge(Draft.chain([x1, x2], torch.stack([p0, p1[x1]])), Draft.chain(list(y)))
            assert draft.parents == [-1, 0, -1, 2] and draft.tokens == [x1, x2, *y]  # the lookup: its own branch
            tokens = [-1] + draft.tokens
            q = torch.stack([q0, q1[x1], q2[x1, x2], q1[y[0]], q2[y[0], y[1]]])
            p = torch.cat([p0[None], draft.probs])  # row c: what node c was drawn from (the engine's layout)
            outcomes = enumerate_outcomes(
                lambda rng: (lambda r: (tuple(r[0]), r[1]))(sample_tree(tokens, draft.children(), q, p, rng)))
            for (path, nxt), pr in outcomes.items():
                for k, v in _first_two(list(path), nxt, tokens, q1).items():
                    got[k] += w * pr * v
        assert_close(got, {(a, b): float(q0[a] * q1[a, b]) for a in range(V) for b in range(V)})


def test_merge_shares_prefixes_of_point_masses_only():
    from selfspec.decode.draft import Draft, merge

    greedy = merge(Draft.chain([1, 2, 3]), Draft.chain([1, 2, 4, 5]))  # deterministic both: one trie
    assert greedy.tokens == [1, 2, 3, 4, 5] and greedy.parents == [-1, 0, 1, 1, 3] and greedy.probs is None
    assert merge(Draft.chain([1, 2]), Draft.chain([1, 2])).is_chain  # a lookup inside the head's chain adds nothing
    rows = torch.full((2, V), 1.0 / V)
    sampled = merge(Draft.chain([1, 2], rows), Draft.chain([1, 3]))  # a drawn node never absorbs a fixed one
    assert sampled.tokens == [1, 2, 1, 3] and sampled.parents == [-1, 0, -1, 2]
    assert torch.equal(sampled.probs[2:], torch.eye(V)[[1, 3]])
    with pytest.raises(ValueError):
        merge(Draft.chain([1]), Draft.chain([2], rows[:1]))
