"""DSpark drafting in the engine (methods/dspark/drafter.py): greedy output identical to the target's own greedy
decoding on tiny llama / qwen2 / gemma3; a block forced to the target's continuation gives tau == S + 1 with every
slot chained on the token drawn before it; the confidence head cuts the block (to nothing at all, losslessly);
speculative SAMPLING distributed exactly as the target (chi-square over seeds against the exact joint), with a
guided head whose every slot depends on the tokens sampled before it."""

from __future__ import annotations

import pytest
import torch

from selfspec.core.errors import UserError
from selfspec.decode.drafters import build_drafter
from selfspec.decode.engine import generate
from selfspec.methods.dflash.head import build_dflash
from selfspec.methods.dspark.head import build_dspark
from sampling_stats import chi_square_pvalue, exact_joint, sampled_first_three

NEW = 90  # with the ~30-token chat prompt, contexts pass gemma3's 64-token sliding window


def _head(target, **kw):
    torch.manual_seed(0)
    kw = {"block_size": 6, "num_layers": 2, "markov_rank": 8, **kw}
    return build_dspark(target.model, **kw)


CASES = {  # a random head: little is accepted, but whatever it drafts the text must stay the target's
    "block": {},
    "short": {"num_draft": 2},
    "smallvocab": {"head": {"block_size": 4, "vocab_size": 50, "draft_vocab": torch.randperm(256)[:50]}},
    "confident": {"min_confidence": 0.3},  # the confidence head's product cuts the block
    "no_confidence_head": {"head": {"confidence_head": False}, "min_confidence": 0.01},
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_identical_to_target(family, case, tiny_target, prompt_of, reference):
    target = tiny_target(family)
    prompt = prompt_of(target)
    opts = dict(CASES[case])
    head = _head(target, **opts.pop("head", {}))
    r = generate(target, build_drafter("dspark", target, head=head, **opts), prompt, NEW, eos_token_ids=[])
    assert r.tokens == reference(family, prompt, NEW)
    assert r.stop_reason == "length" and r.new_tokens == NEW and r.drafted_tokens > 0


def test_beside_a_lookup_greedy_stays_identical(tiny_target, prompt_of, reference):
    """drafter=hybrid: a DSpark head keeps its block (Method.hybrid "block") beside the suffix lookup's branch."""
    target = tiny_target("llama")
    prompt = prompt_of(target, "abc abc abc abc abc abc")
    drafter = build_drafter("hybrid", target, head=_head(target), lookup="suffix")
    r = generate(target, drafter, prompt, NEW, eos_token_ids=[])
    assert r.tokens == reference("llama", prompt, NEW) and r.drafted_tokens > 0


def test_forced_blocks_give_tau_s_plus_one_and_chain_on_the_drawn_token(tiny_target, prompt_of, reference):
    S, rounds = 5, 6
    new = 1 + rounds * (S + 1)  # the prefill's token, then full blocks of S drafts + the bonus
    target = tiny_target("llama")
    prompt = prompt_of(target)
    truth = reference("llama", prompt, new + S + 1)
    head = _head(target, block_size=S)
    real = head.chain_step
    prevs: list[list[int]] = []
    committed: list[list[int]] = []

    def chain_step(base, normed, prev):
        logits, conf = real(base, normed, prev)
        k = len(prevs[-1])
        prevs[-1].append(int(prev))
        i = len(committed[-1]) - len(prompt) + k  # slot k drafts the token after the k-th drafted one
        out = torch.full_like(logits, -30.0)
        out[0, truth[i] if i < len(truth) else 0] = 0.0
        return out, conf

    drafter = build_drafter("dspark", target, head=head)
    propose = drafter.propose

    def recording(seq, max_depth, sampling):
        committed.append(seq[0].tolist())
        prevs.append([])
        return propose(seq, max_depth, sampling)

    head.chain_step, drafter.propose = chain_step, recording
    r = generate(target, drafter, prompt, new, eos_token_ids=[])
    assert r.tokens == truth[:new]
    assert r.tau == S + 1 and r.verify_passes == rounds and r.accept_by_position == [1.0] * S
    for seq, chained in zip(committed, prevs):  # slot 0 reads the anchor, slot k the token drafted at slot k-1
        done = len(seq) - len(prompt)
        assert chained == [seq[-1]] + truth[done:done + len(chained) - 1]


def test_the_confidence_head_cuts_the_block(tiny_target, prompt_of, reference):
    """Its bias at -20: every slot's predicted acceptance ~0, so at min_confidence 0.5 nothing is proposed (each
    pass is the target's own step); at +20 every slot passes and whole blocks are proposed; both lossless."""
    target = tiny_target("qwen2")
    prompt = prompt_of(target)
    head = _head(target, block_size=4)
    want = reference("qwen2", prompt, 20)
    with torch.no_grad():
        head.confidence_head.proj.bias.fill_(-20.0)
    r = generate(target, build_drafter("dspark", target, head=head, min_confidence=0.5), prompt, 20, eos_token_ids=[])
    assert r.tokens == want and r.drafted_tokens == 0 and r.tau == 1.0
    with torch.no_grad():
        head.confidence_head.proj.bias.fill_(20.0)
    r = generate(target, build_drafter("dspark", target, head=head, min_confidence=0.5), prompt, 20, eos_token_ids=[])
    assert r.tokens == want and len(r.proposed_by_position) == 4  # whole blocks, slots 0..3
    assert r.proposed_by_position[0] == r.verify_passes - 1  # every pass drafted (the last had 1 token left to make)


def test_num_draft_and_mismatched_heads(tiny_target, capsys):
    target = tiny_target("llama")
    head = _head(target, block_size=6)
    assert build_drafter("dspark", target, head=head).num_draft == 6  # every slot drafts: S tokens per pass
    assert build_drafter("dspark", target, head=head, num_draft=3).num_draft == 3
    assert capsys.readouterr().err == ""
    assert build_drafter("dspark", target, head=head, num_draft=9).num_draft == 6
    assert "num_draft=9" in capsys.readouterr().err
    with pytest.raises(UserError, match="use drafter=dflash"):
        build_drafter("dspark", target, head=build_dflash(target.model, block_size=4, num_layers=1))
    with pytest.raises(UserError, match="use drafter=dspark"):
        build_drafter("dflash", target, head=head)
    with pytest.raises(UserError, match="not a tree"):
        build_drafter("dspark", target, head=head, chain=False)


T, TOP_K, RUNS = 1.0, 3, 400


@pytest.mark.parametrize("kind", ["random", "guided"])
def test_sampling_matches_target_distribution(kind, tiny_target, prompt_of):
    target = tiny_target("llama")
    prompt = prompt_of(target, "abcabcabc")
    if kind == "random":  # reduced draft vocabulary: little is accepted, but the wiring of p must stay exact
        drafter = build_drafter("dspark", target, head=_head(target, block_size=3, vocab_size=64,
                                                             draft_vocab=torch.arange(64) + 64))
    else:
        drafter = _guided(target, block_size=3)
    counts, accepted = sampled_first_three(target, drafter, prompt, RUNS, T, TOP_K)
    assert chi_square_pvalue(counts, exact_joint(target.model, prompt, T, TOP_K), RUNS) > 1e-3
    if kind == "guided":
        assert accepted > RUNS // 4  # drafts are really accepted (and rejected: p != q) in this test


def _guided(target, block_size: int):
    """A DSpark drafter whose slot k is the target's own next-token logits (sharpened: p != q) after the committed
    text AND the tokens sampled at slots 0..k-1, read from the previous token chain_step is given: semi-autoregressive
    as a trained head, accepted often; a drafter that chained another token than the one it drew would draw from
    rows that are not the ones it reports."""
    head = _head(target, block_size=block_size, num_layers=1)
    drafter = build_drafter("dspark", target, head=head)
    ctx: list[int] = []
    slot = [0]
    real_step, real_propose = head.chain_step, drafter.propose

    def propose(seq, max_depth, sampling):
        ctx[:], slot[0] = seq[0].tolist(), 0
        return real_propose(seq, max_depth, sampling)

    def chain_step(base, normed, prev):
        _, conf = real_step(base, normed, prev)
        if slot[0] == 0:
            assert int(prev) == ctx[-1]  # slot 0 reads the anchor
        else:
            ctx.append(int(prev))  # the token drawn at the previous slot
        slot[0] += 1
        logits = target.model(torch.tensor([ctx])).logits[0, -1].float()
        return (logits * 1.5)[None], conf

    drafter.propose, head.chain_step = propose, chain_step
    return drafter


def test_each_sampled_token_comes_with_the_row_it_was_drawn_from(tiny_target, prompt_of, monkeypatch):
    """Under sampling every proposed token is a draw from the row its Draft reports, and slot k's row is the head's
    processed logits chained on the token drawn at slot k-1 (the anchor at slot 0): what keeps the chain rule exact,
    checked draw by draw (the chi-square test above sees only the text's distribution)."""
    from selfspec.decode import verify

    target = tiny_target("llama")
    prompt = prompt_of(target)
    head = _head(target, block_size=4)
    with torch.no_grad():
        for p in head.markov_head.parameters():
            p.normal_()  # a bias large enough that a row chained on another token differs
    drafter = build_drafter("dspark", target, head=head)
    draws, checked = [], []
    real_draw, real_propose = verify.draw, drafter.propose

    def draw(dist, generator=None):
        token = real_draw(dist, generator)
        draws.append((dist.clone(), token))
        return token

    def propose(seq, max_depth, sampling):
        L = seq.shape[1]
        with torch.no_grad():
            # the slots the drafter reads, as it reads them: a product over other rows may round apart (the kernels
            # of target/kernels.py take the row count into account)
            hidden = head.block_hidden(seq[:, L - 1], L - 1, drafter.cache)[0, :min(drafter.num_draft, max_depth)]
            base, normed = head.logits(hidden), head.norm(hidden)
        draws.clear()
        monkeypatch.setattr(verify, "draw", draw)
        draft = real_propose(seq, max_depth, sampling)
        monkeypatch.setattr(verify, "draw", real_draw)
        assert [t for _, t in draws] == draft.tokens  # full vocabulary: draft ids are target ids
        prev = int(seq[0, L - 1])
        for k, (dist, token) in enumerate(draws):
            assert torch.equal(draft.probs[k], dist)
            with torch.no_grad():
                logits, _ = head.chain_step(base[k:k + 1], normed[k:k + 1], torch.tensor([prev]))
            want = verify.probs(drafter.vocab.logits(logits[0]), sampling.temperature, sampling.top_k, sampling.top_p)
            assert torch.equal(dist, want)
            prev = token
        checked.append(len(draws))
        return draft

    drafter.propose = propose
    generate(target, drafter, prompt, 30, temperature=0.8, top_k=20, seed=0, eos_token_ids=[])
    assert len(checked) > 5 and sum(checked) > 20
