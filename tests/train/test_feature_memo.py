"""The feature memo and soft labels over a draft vocabulary: cheaper paths that must give the same numbers."""

import pytest
import torch

from selfspec.target.model import lm_logits, load_target
from selfspec.train.features import soft_labels
from selfspec.data.features import FeatureMemo, last_features
from tolerance import relative_bound, terms


def _batch(lengths, t=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (len(lengths), t), generator=g)
    attn = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        attn[b, :n] = 1
    return {"input_ids": ids * attn, "attention_mask": attn, "index": torch.arange(len(lengths)),
            "loss_mask": attn.clone()}


@pytest.mark.kernels  # two kernel paths compared (tests/tolerance.py); make test reruns it capped
def test_soft_labels_over_draft_rows_equal_the_full_softmax_restricted():
    model = load_target("tiny:llama").model
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 7, model.config.hidden_size, generator=g)
    full = lm_logits(model, hidden)
    # 39 random rows and the first position's argmax, without the last position's: some argmaxes in, some out
    # (unseeded, all 14 fell outside 40 random rows of 256 one run in ten)
    top = full.argmax(-1).flatten()
    others = torch.randperm(256, generator=g)
    others = others[(others != top[0]) & (others != top[-1])]
    vocab = torch.cat([top[:1], others[:39]])
    p, inside = soft_labels(model, hidden, vocab)
    # 40 rows' GEMM against all 256 rows': the logits move by dz <= the bound times S (tests/tolerance.py), and
    # p_i by p_i (|dz_i| + sum_j p_j |dz_j|) <= 2 p_i max|dz|, besides the softmax's own sum over 40
    dz = relative_bound(torch.float32, hidden.shape[-1]) * terms(hidden, model.get_output_embeddings().weight[vocab])
    rtol = 2 * dz + relative_bound(torch.float32, len(vocab), ops=2)
    torch.testing.assert_close(p, torch.softmax(full[..., vocab], -1), rtol=rtol, atol=0)
    in_vocab = torch.isin(full.argmax(-1), vocab).float()
    assert torch.equal(inside, in_vocab) and 0 < in_vocab.sum() < in_vocab.numel()
    # a known argmax (the memo's) is used as given instead of the full lm_head's
    p2, inside2 = soft_labels(model, hidden, vocab, argmax=full.argmax(-1))
    assert torch.equal(p, p2) and torch.equal(inside, inside2)
    p3, inside3 = soft_labels(model, hidden, vocab, argmax=torch.full((2, 7), int(vocab[0])))
    assert torch.equal(inside3, torch.ones(2, 7))


def test_memo_gives_each_sequence_the_same_rows_whatever_its_batch_and_whether_cached():
    model = load_target("tiny:llama").model
    memo = FeatureMemo(1.0, last_features(model))
    batch = _batch([12, 5, 9])
    first = memo(batch)
    assert set(first) == {"features", "target_argmax"} and len(memo.rows) == 3
    again = memo(batch)  # now from RAM
    assert all(torch.equal(first[k], again[k]) for k in first)
    # sequence 1 alone (unpadded) gets the same rows as inside the padded batch
    alone = FeatureMemo(1.0, last_features(model))({k: v[1:2] if v.dim() == 1 else v[1:2, :5]
                                                    for k, v in batch.items()})
    assert torch.equal(alone["features"][0], first["features"][1, :5])
    # the kept argmax is the target's full-vocabulary argmax on the (bf16-rounded) features; pads are zero
    want = lm_logits(model, first["features"][0]).argmax(-1)
    assert torch.equal(first["target_argmax"][0], want)
    assert first["features"][1, 5:].abs().sum() == 0
    assert torch.equal(first["features"], first["features"].bfloat16().float())


def test_memo_respects_its_budget():
    model = load_target("tiny:llama").model
    memo = FeatureMemo(1e-9, last_features(model))
    out = memo(_batch([12, 5]))
    assert not memo.rows and memo.used == 0 and out["features"].shape[:2] == (2, 12)


def test_eagle_loss_is_the_same_with_the_memos_argmax():
    """eagle_loss on memo features: with the memo's argmax, or recomputing it through the full lm_head."""
    from selfspec.methods.eagle.head import build_eagle
    from selfspec.methods.eagle.train import EagleLossConfig, EagleTTTConfig, eagle_loss, unrolled_loss

    target = load_target("tiny:llama")
    torch.manual_seed(0)
    head = build_eagle(target.model, vocab_size=60, draft_vocab=torch.randperm(256)[:60])
    batch = _batch([12, 8])
    batch.update(FeatureMemo(1.0, last_features(target.model))(batch))
    lc = EagleLossConfig(noise_std=0.0)
    without = {k: v for k, v in batch.items() if k != "target_argmax"}
    for loss in (lambda b: eagle_loss(head, head, target.model, b, lc),
                 lambda b: unrolled_loss(head, head, target.model, b, lc, EagleTTTConfig(steps=3))):
        (a, sa), (b, sb) = loss(batch), loss(without)
        assert torch.equal(a, b) and sa["acc"] == sb["acc"]
