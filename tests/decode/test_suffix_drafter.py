"""The suffix drafter (decode/drafters/suffix.py) and its corpus index (decode/drafters/corpus.py): counts against
brute force, the incremental trie against one built at once, the longest match, the frequency-scored expansion, and
the corpus's suffix array against the trie on the same text."""

from __future__ import annotations

import random

import pytest
import torch

from selfspec.decode.draft import Sampling
from selfspec.decode.drafters.corpus import Corpus
from selfspec.decode.drafters.suffix import SuffixDrafter, SuffixTrie, _TrieIndex

GREEDY = Sampling()


def _count(text: list[int], sub: list[int]) -> int:
    return sum(text[i:i + len(sub)] == sub for i in range(len(text) - len(sub) + 1))


def _nodes(node, prefix=()):
    yield prefix, node
    for t, c in node[1].items():
        yield from _nodes(c, prefix + (t,))


@pytest.mark.parametrize("seed", range(3))
def test_trie_counts_every_substring_up_to_its_depth(seed):
    rng = random.Random(seed)
    text = [rng.randrange(4) for _ in range(60)]
    trie = SuffixTrie(depth=5)
    trie.extend(text[:17])  # in pieces, as committed tokens arrive
    trie.extend(text[17:18])
    trie.extend(text[18:])
    seen = 0
    for sub, node in _nodes(trie.root):
        if sub:
            assert node[0] == _count(text, list(sub)), sub
            seen += 1
    # every substring of length <= 5 is in the trie, none longer
    assert seen == len({tuple(text[i:i + n]) for n in range(1, 6) for i in range(len(text) - n + 1)})


def test_longest_match_needs_a_continuation():
    trie = SuffixTrie(depth=8)
    text = [1, 2, 3, 9, 5, 2, 3, 7, 1, 2, 3]
    trie.extend(text)
    node, m = _TrieIndex(trie).match(text[-7:])
    assert m == 3  # "1 2 3" occurred at the start, followed by 9
    probs = {t: p for t, _, p in _TrieIndex(trie).children(node)}
    assert probs == {9: 1.0}  # the occurrence at the end has no continuation and does not count
    two = trie.walk([2, 3])
    assert {t: p for t, _, p in _TrieIndex(trie).children(two)} == {9: 0.5, 7: 0.5}


def _propose(text, **kw):
    d = SuffixDrafter(**kw)
    seq = torch.tensor([text])
    d.reset(seq)
    return d, d.propose(seq, 64, GREEDY)


def test_chain_follows_the_most_frequent_continuation_and_stops_below_min_prob():
    a, b = [10, 11, 12, 13, 14, 15], [10, 11, 12, 20, 21, 22]
    text = a + [1] + a + [2] + b + [3, 10, 11, 12]
    # "10 11 12" occurred 3 times with a continuation: 13 twice, 20 once; the a's then go on alike up to 15, after
    # which one had 1 and the other 2 (1/2 each): the chain stops there, its score 2/3 * 1/2 below min_prob
    d, draft = _propose(text, num_draft=10, min_prob=0.5, alpha=4.0)
    assert draft.tokens == [13, 14, 15] and draft.is_chain
    assert d.expected == pytest.approx(3 * 2 / 3)
    _, none = _propose(text, num_draft=8, min_prob=0.7)
    assert none is None  # the best first token has 2/3 < 0.7


def test_depth_grows_with_the_match_length_and_backs_off_past_the_trie_depth():
    text = list(range(30)) + [100] + list(range(30))
    _, short = _propose(text[:31] + [3], alpha=1.0, num_draft=16)  # a 1-token match: 1 token deep
    assert short.tokens == [4]
    _, long = _propose(text, alpha=1.0, num_draft=16, depth=8)  # a 7-token match: 7 deep, past the trie's depth
    assert long.tokens == [100, 0, 1, 2, 3, 4, 5]


def test_tree_takes_the_best_nodes_parents_first():
    text = [5, 1, 2, 0, 5, 1, 2, 0, 5, 3, 4, 0, 5]
    # "0 5" occurred twice with a continuation: 1 and 3 (1/2 each), each then followed by one token
    _, draft = _propose(text, tree=True, num_draft=4, min_prob=0.2)
    assert draft.tokens == [1, 3, 2, 4] and draft.parents == [-1, -1, 0, 1]


def test_incremental_updates_equal_a_fresh_drafter():
    rng = random.Random(5)
    text = [rng.randrange(6) for _ in range(200)]
    live = SuffixDrafter(num_draft=6, tree=True, min_prob=0.0)
    live.reset(torch.tensor([text[:20]]))
    for L in range(20, 200, 7):
        seq = torch.tensor([text[:L]])
        live.observe(seq, None, 0)
        fresh = SuffixDrafter(num_draft=6, tree=True, min_prob=0.0)
        a, b = live.propose(seq, 8, GREEDY), fresh.propose(seq, 8, GREEDY)
        assert (a.tokens, a.parents) == (b.tokens, b.parents) and live.expected == fresh.expected


@pytest.mark.parametrize("seed", range(3))
def test_corpus_suffix_array_equals_the_trie(seed):
    rng = random.Random(seed)
    docs = [[rng.randrange(5) for _ in range(rng.randrange(1, 40))] for _ in range(6)]
    corpus = Corpus(docs, depth=6)
    trie = SuffixTrie(depth=6)
    for doc in docs:  # documents apart: no substring crosses two
        trie.open = []
        trie.extend(doc)
    index = _TrieIndex(trie)

    def tree(ix, node, depth=0):
        kids = sorted((t, round(p, 12), tree(ix, c, depth + 1)) for t, c, p in ix.children(node))
        return kids

    for _ in range(30):
        tail = [rng.randrange(5) for _ in range(rng.randrange(1, 8))]
        a, b = corpus.match(tail), index.match(tail)
        assert (a is None) == (b is None)
        if a is not None:
            assert a[1] == b[1]
            assert tree(corpus, a[0]) == tree(index, b[0])


def test_drafter_uses_the_corpus_when_it_scores_higher():
    corpus = Corpus([[7, 8, 9, 10, 11, 12]], depth=8)
    d = SuffixDrafter(num_draft=4, alpha=2.0, corpus=corpus)  # the 2-token match "7 8" drafts 4 deep
    seq = torch.tensor([[1, 2, 3, 7, 8]])
    d.reset(seq)
    assert d.propose(seq, 8, GREEDY).tokens == [9, 10, 11, 12]  # the text itself has no earlier "7 8"


@pytest.mark.parametrize("collector_on", [True, False])
def test_extending_the_trie_leaves_the_cyclic_collector_as_it_found_it(collector_on):
    """extend holds Python's collector off while it counts (its nodes form no cycle) and gives it back as it was."""
    import gc

    was = gc.isenabled()
    (gc.enable if collector_on else gc.disable)()
    try:
        trie = SuffixTrie(depth=4)
        trie.extend([1, 2, 3, 1, 2])
        assert gc.isenabled() is collector_on
        with pytest.raises(TypeError):
            trie.extend([1, [2]])  # an unhashable token: the error passes, the collector is still given back
        assert gc.isenabled() is collector_on and trie.walk([1, 2])[0] == 2
    finally:
        (gc.enable if was else gc.disable)()
