"""Suffix drafting (SuffixDecoding, Oliaro et al. 2024): no model, no training. A suffix trie of the prompt and the
output so far (every substring of at most `depth` tokens, with how often it occurs), updated as tokens are
committed, never rebuilt; optionally a second, static index over a corpus of earlier outputs (decode/drafters/
corpus.py). Each round:

    match    the longest suffix of the committed text (at most depth - 1 tokens) that occurred earlier with a
             continuation
    expand   best first from there: a node's score is the product of the empirical probabilities of the tokens on
             its path, count(context + t) / count(context followed by anything); nodes scoring below `min_prob`
             are not proposed, and at most `num_draft` nodes, ceil(alpha * match length) deep: a long, frequent
             match drafts deep, a short or ambiguous one little or nothing

The draft is a chain (the most frequent continuation) or, with tree=True, a tree of the best-scoring nodes. Its
tokens are deterministic given the committed text: verification treats them as point masses (exact under
sampling). `expected` after each propose: the draft's estimated accepted length, the sum of its nodes' scores
(the hybrid drafter weighs it against a head's).
"""

from __future__ import annotations

import gc
import heapq
import itertools
import math
from typing import Optional

import torch

from selfspec.decode.draft import NUM_DRAFT, Draft, Sampling
from selfspec.decode.drafters import SUFFIX_ALPHA, SUFFIX_DEPTH, SUFFIX_MIN_PROB


class SuffixTrie:
    """Counts of every substring of at most `depth` tokens of the text appended so far. A node is a list
    [count, {token: child}]; appending a token extends the depth - 1 newest open suffixes by one token each."""

    def __init__(self, depth: int):
        self.depth = depth
        self.root: list = [0, {}]
        self.open: list[list] = []  # nodes of the suffixes that can still grow, oldest (deepest) first

    def extend(self, tokens) -> None:
        """Count the new tokens' substrings: O(len(tokens) x depth) node visits. Python's cyclic collector is held
        off meanwhile: the nodes form no cycle, and its full passes over a large trie in a process as big as a decode
        (torch, the model) cost more than the counting: tests/decode/test_hybrid.py's sampling test, 642 calls over a
        prompt of its target's whole vocabulary, spent 9.7 s in them with the collector on and 1.3 s with it held."""
        was_on = gc.isenabled()
        gc.disable()
        try:
            for t in tokens:
                grown = []
                for node in self.open + [self.root]:
                    child = node[1].get(t)
                    if child is None:
                        child = node[1][t] = [0, {}]
                    child[0] += 1
                    grown.append(child)
                self.root[0] += 1
                self.open = grown[max(0, len(grown) - (self.depth - 1)):]  # those at full depth stop growing
        finally:
            if was_on:
                gc.enable()

    def walk(self, tokens) -> Optional[list]:
        node = self.root
        for t in tokens:
            node = node[1].get(t)
            if node is None:
                return None
        return node



class SuffixDrafter:
    name = "suffix"

    def __init__(self, num_draft: Optional[int] = None, depth: int = SUFFIX_DEPTH, min_prob: float = SUFFIX_MIN_PROB,
                 alpha: float = SUFFIX_ALPHA, tree: bool = False, corpus=None):
        """num_draft: most nodes per draft (None: NUM_DRAFT); depth: the longest substring counted (matches of at
        most depth - 1 tokens); min_prob: the lowest path probability proposed; alpha: draft depth per matched token;
        tree: propose the best nodes as a tree, else the single most frequent chain; corpus: a static
        decode.drafters.corpus.Corpus matched as well (its draft used when it scores higher)."""
        self.num_draft = NUM_DRAFT if num_draft is None else num_draft
        self.depth, self.min_prob, self.alpha, self.tree, self.corpus = depth, min_prob, alpha, tree, corpus
        self.trie = SuffixTrie(depth)
        self.seen = 0  # tokens of the committed text already in the trie
        self.expected = 0.0

    def reset(self, prompt_ids: torch.Tensor) -> None:
        self.trie = SuffixTrie(self.depth)
        self.seen = 0

    def observe(self, seq: torch.Tensor, features: torch.Tensor, start: int) -> None:
        self._catch_up(seq)

    def _catch_up(self, seq: torch.Tensor) -> None:
        """Append the committed tokens the trie has not seen (the incremental update: O(new tokens x depth))."""
        L = seq.shape[1]
        if L < self.seen:  # a shorter text than before: a new sequence without reset
            self.reset(seq)
        if L > self.seen:
            self.trie.extend(seq[0, self.seen:].tolist())
            self.seen = L

    def propose(self, seq: torch.Tensor, max_depth: int, sampling: Sampling) -> Optional[Draft]:
        self._catch_up(seq)
        budget = min(self.num_draft, max_depth)
        tail = seq[0, max(0, seq.shape[1] - self.depth + 1):].tolist()
        best, self.expected = None, 0.0
        for index in ([_TrieIndex(self.trie)] + ([self.corpus] if self.corpus is not None else [])):
            found = index.match(tail)
            if found is None:
                continue
            node, m = found
            draft, expected = _expand(index, node, tail, budget, max(1, min(max_depth, math.ceil(self.alpha * m))),
                                      self.min_prob, self.tree)
            if draft is not None and expected > self.expected:
                best, self.expected = draft, expected
        return best


class _TrieIndex:
    """The per-request trie behind the small interface `_expand` walks (corpus.Corpus has the same):
    match(tail) -> (node, match length) | None; children(node) -> [(token, child, probability)], the probability
    among the occurrences that have a continuation (the text's own end has none)."""

    def __init__(self, trie: SuffixTrie):
        self.trie = trie

    def match(self, tail: list[int]) -> Optional[tuple[list, int]]:
        """The longest suffix of `tail` that occurred before with a continuation. Having one is monotone in the
        length (an earlier occurrence of a suffix is one of each shorter suffix too): binary search."""
        tail = tail[max(0, len(tail) - self.trie.depth + 1):]
        lo, hi, best = 1, len(tail), None
        while lo <= hi:
            m = (lo + hi) // 2
            node = self.trie.walk(tail[len(tail) - m:])
            if node is not None and node[1]:
                best, lo = (node, m), m + 1
            else:
                hi = m - 1
        return best

    def children(self, node: list) -> list[tuple[int, list, float]]:
        total = sum(c[0] for c in node[1].values())
        return [(t, c, c[0] / total) for t, c in node[1].items()]


def _expand(index, node, tail: list[int], budget: int, max_depth: int, min_prob: float,
            tree: bool) -> tuple[Optional[Draft], float]:
    """Best-first from `node` (matched at the end of `tail`): the `budget` highest-scoring nodes (score = path
    probability >= min_prob) at most max_depth deep, as a tree (parents first) or the best chain; -> (draft or None,
    sum of the proposed scores). A node with no continuation in the index (its substring reached the index's depth,
    or it only ever occurred at the end) backs off to the longest suffix of the text so far that has one."""
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    # entries (-score, tie-break, token, node, parent index, depth, path of tokens): the best score, then the first
    order = itertools.count()
    heap = [(-p, next(order), t, c, -1, 1, (t,)) for t, c, p in index.children(node) if p >= min_prob]
    heapq.heapify(heap)
    while heap and len(tokens) < budget:
        neg, _, t, child, parent, d, path = heapq.heappop(heap)
        tokens.append(t)
        parents.append(parent)
        scores.append(-neg)
        if not tree:
            heap = []  # a chain: only the best child of the node just taken
        if d < max_depth:
            me = len(tokens) - 1
            kids = index.children(child)
            if not kids:
                found = index.match(tail + list(path))
                kids = index.children(found[0]) if found is not None else []
            for t2, c2, p in kids:
                if -neg * p >= min_prob:
                    heapq.heappush(heap, (neg * p, next(order), t2, c2, me, d + 1, path + (t2,)))
    if not tokens:
        return None, 0.0
    return Draft(tokens, parents, scores=scores), sum(scores)
