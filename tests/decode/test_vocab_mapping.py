"""decode/draft.py's Vocab: the ONE mapping from a drafter's vocabulary to the target's. Every drafter holds one, and
every sampled draft token comes with the target-vocabulary row it was drawn from: a drafter that mapped ids one way
and rows another (the drift this replaced: one copy truncated and padded, another only padded) fails here."""

from __future__ import annotations

import pytest
import torch

from selfspec.decode.draft import Sampling, Vocab
from selfspec.decode.drafters import build_drafter
from selfspec.methods.dflash.head import build_dflash
from selfspec.methods.eagle.head import build_eagle
from selfspec.methods.eagle3.head import build_eagle3
from selfspec.methods.layerskip.head import build_layerskip
from tolerance import assert_close

V = 10


def _sums_to_one(rows: torch.Tensor) -> None:
    """Each row of probabilities [..., n] sums to 1: softmax's sum and this one, two reductions of length n."""
    assert_close(rows.sum(-1), torch.ones(rows.shape[:-1]), k=rows.shape[-1], ops=2, scale=1.0)


def _sampling(seed: int = 0) -> Sampling:
    return Sampling(temperature=1.0, generator=torch.Generator().manual_seed(seed))


def test_longer_rows_are_cut_before_the_softmax():
    vocab = Vocab(V)
    logits = torch.zeros(V + 6)
    logits[V + 2] = 50.0  # a padding id the target cannot emit, far above the rest
    assert vocab.choose(logits, Sampling())[0] < V  # greedy never picks it
    for seed in range(20):
        d, p = vocab.choose(logits, _sampling(seed))
        row = vocab.rows(p)
        assert d < V and row.shape == (V,)
        _sums_to_one(row)
        assert row[d] > 0


def test_shorter_rows_give_the_missing_ids_zero():
    vocab = Vocab(V)
    d, p = vocab.choose(torch.randn(V - 3), _sampling())
    row = vocab.rows(p)
    assert row.shape == (V,) and (row[V - 3:] == 0).all() and row[d] > 0


def test_reduced_vocabulary_scatters_to_target_ids():
    ids = torch.tensor([7, 2, 9])
    vocab = Vocab(V, ids)
    d, p = vocab.choose(torch.tensor([0.0, 1.0, 2.0]), _sampling())
    row = vocab.rows(p)
    assert vocab.target_id(d) == int(ids[d]) and row[vocab.target_id(d)] == p[d]
    assert row[[0, 1, 3, 4, 5, 6, 8]].sum() == 0
    _sums_to_one(row)
    assert vocab.target_ids(torch.tensor([2, 0])).tolist() == [9, 7]
    batch = vocab.rows(torch.softmax(torch.randn(4, 3), -1))  # a block's rows at once
    assert batch.shape == (4, V)
    _sums_to_one(batch)


def test_a_distribution_over_ids_the_target_lacks_is_refused():
    with pytest.raises(ValueError, match="Vocab.logits"):
        Vocab(V).rows(torch.full((V + 1,), 1 / (V + 1)))


def _heads(target):
    torch.manual_seed(0)
    n = target.model.get_output_embeddings().weight.shape[0]
    reduced = torch.arange(n - 1, n - 41, -1)  # 40 target ids, not the first ones: a wrong mapping shows
    return {
        "eagle": build_eagle(target.model, vocab_size=40, draft_vocab=reduced),
        "eagle3": build_eagle3(target.model, vocab_size=40, draft_vocab=reduced),
        "dflash": build_dflash(target.model, block_size=4, num_layers=1, vocab_size=40, draft_vocab=reduced),
        "layerskip": build_layerskip(target.model, exit_layer=1, vocab_size=40, draft_vocab=reduced),
    }


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "dflash", "layerskip"])
def test_every_drafter_maps_tokens_and_rows_through_its_vocab(kind, tiny_target, prompt_of):
    """Sampled drafts from a reduced draft vocabulary: each token is a draft-vocabulary target id, and the row
    attached to it is a distribution over the target's ids that gives that token positive probability."""
    from selfspec.decode.engine import generate

    target = tiny_target("llama")
    head = _heads(target)[kind].eval()
    drafter = build_drafter(kind, target, head=head)
    assert isinstance(drafter.vocab, Vocab) and drafter.vocab.vocab_size == target.model.config.vocab_size
    allowed = set(head.draft_token_ids().tolist())
    seen = []
    propose = drafter.propose

    def watched(seq, max_depth, sampling):
        draft = propose(seq, max_depth, sampling)
        if draft is not None:
            seen.append(draft)
        return draft

    drafter.propose = watched
    generate(target, drafter, prompt_of(target), 12, temperature=1.0, seed=0, eos_token_ids=[])
    assert seen
    for draft in seen:
        assert set(draft.tokens) <= allowed
        assert draft.probs.shape == (len(draft.tokens), drafter.vocab.vocab_size)
        _sums_to_one(draft.probs)
        for i, t in enumerate(draft.tokens):
            assert draft.probs[i, t] > 0
            assert draft.probs[i, sorted(set(range(drafter.vocab.vocab_size)) - allowed)].sum() == 0
