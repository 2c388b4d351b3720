"""DFlash block drafting in the engine (methods/dflash/drafter.py): with the block forced to the target's own
continuation (draft_block patched to one-hot logits), every full block is accepted and tau == S exactly; blocks
right only up to a varying position keep the draft's context cache equal to the committed positions' states;
end-of-turn inside a block, max_new_tokens mid-block, a prompt at the context limit, num_draft and min_confidence;
head/drafter mismatches are one-line errors naming the right drafter."""

from __future__ import annotations

import itertools

import pytest
import torch

from selfspec.core.errors import UserError
from selfspec.decode.drafters import build_drafter
from selfspec.decode.engine import generate
from selfspec.heads.checkpoint import head_record, save_head
from selfspec.methods.dflash.head import build_dflash
from selfspec.methods.eagle.head import build_eagle
from selfspec.methods.eagle3.head import build_eagle3
from tolerance import assert_close, layers

NEW = 40


def _forced(head, prompt_len: int, truth: list[int], right_for=None):
    """Patch head.draft_block: one-hot logits of `truth` (the target's greedy continuation after the prompt) at each
    block position, wrong (the next id) from block row right_for(anchor_pos) on. The real draft_block still runs
    first, so its own check (anchor at len(cache)) guards every call."""
    real = head.draft_block

    def draft_block(anchor_id, anchor_pos, cache):
        out = real(anchor_id, anchor_pos, cache)  # [1, S-1, V] fp32
        logits = torch.full_like(out, -30.0)
        good = out.shape[1] if right_for is None else right_for(anchor_pos)
        for j in range(out.shape[1]):  # row j predicts the token at position anchor_pos + 1 + j
            i = anchor_pos + 1 + j - prompt_len
            tok = truth[i] if i < len(truth) else 0
            logits[0, j, tok if j < good else (tok + 1) % out.shape[-1]] = 0.0
        return logits

    head.draft_block = draft_block
    return head


def _setup(tiny_target, prompt_of, reference, family, block_size, new, prompt=None):
    target = tiny_target(family)
    prompt = prompt or prompt_of(target)
    torch.manual_seed(0)
    head = build_dflash(target.model, block_size=block_size, num_layers=1)
    return target, prompt, head, reference(family, prompt, new + block_size)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("S", [2, 4, 8])
def test_forced_full_blocks_give_tau_equal_to_block_size(family, S, tiny_target, prompt_of, reference):
    rounds = 6
    new = 1 + rounds * S  # the prefill's token, then full blocks of S-1 drafts + the bonus
    target, prompt, head, truth = _setup(tiny_target, prompt_of, reference, family, S, new)
    r = generate(target, build_drafter("dflash", target, head=_forced(head, len(prompt), truth)), prompt, new,
                 eos_token_ids=[])
    assert r.tokens == truth[:new]
    assert r.tau == S and r.verify_passes == rounds and r.accept_by_position == [1.0] * (S - 1)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_partly_right_blocks_keep_only_committed_context(family, tiny_target, prompt_of, reference):
    """Blocks right for 0..S-1 positions: output identical, and the context cache afterwards equals the one built
    from one target pass over the committed text (rejected positions never entered it)."""
    S = 6
    target, prompt, head, truth = _setup(tiny_target, prompt_of, reference, family, S, NEW)
    calls = itertools.count()  # pass i drafts a block right for its first i % S positions
    drafter = build_drafter("dflash", target, head=_forced(head, len(prompt), truth, lambda _: next(calls) % S))
    r = generate(target, drafter, prompt, NEW, eos_token_ids=[])
    assert r.tokens == truth[:NEW]
    assert 1.5 < r.tau < S and len(set(r.accept_by_position)) > 1  # every acceptance length occurs
    seq = torch.tensor([prompt + r.tokens])
    with torch.no_grad():
        out = target.model(seq, output_hidden_states=True)
        want = head.extend_cache(head.new_cache(), head.context(head.target_states(out.hidden_states)))
    n = len(drafter.cache)
    assert len(prompt) < n < seq.shape[1]  # committed positions only (the last pass's are never observed)
    # the target's layers (verification passes against one pass), then fc, hidden_norm, k/v_proj and k_norm
    tol = layers(target.model.config, target.model.config.num_hidden_layers, width=head.fc.in_features,
                 positions=seq.shape[1], ops=4)
    for got_k, want_k in zip(drafter.cache.keys + drafter.cache.values, want.keys + want.values):
        assert_close(got_k, want_k[:, :, :n], **tol)


def test_end_of_turn_inside_a_block_stops_there(tiny_target, prompt_of, reference):
    S = 5
    target, prompt, head, truth = _setup(tiny_target, prompt_of, reference, "llama", S, NEW)
    # first occurrence strictly inside a block (blocks commit truth[1:6], truth[6:11], ...)
    j = next(j for j in range(2, NEW) if truth.index(truth[j]) == j and (j - 1) % S not in (0, S - 1))
    seen: list[int] = []
    r = generate(target, build_drafter("dflash", target, head=_forced(head, len(prompt), truth)), prompt, NEW,
                 eos_token_ids=[truth[j]], stream_callback=seen.extend)
    assert r.tokens == truth[: j + 1] and r.stop_reason == "eos" and seen == r.tokens


@pytest.mark.parametrize("new", [1, 2, 4, 6, 9])
def test_max_new_tokens_exact_even_mid_block(new, tiny_target, prompt_of, reference):
    S = 5
    target, prompt, head, truth = _setup(tiny_target, prompt_of, reference, "gemma3", S, new)
    r = generate(target, build_drafter("dflash", target, head=_forced(head, len(prompt), truth)), prompt, new,
                 eos_token_ids=[])
    assert r.tokens == truth[:new] and r.stop_reason == "length"


def test_prompt_at_the_context_limit(tiny_target, prompt_of, reference):
    target = tiny_target("llama")
    limit = target.model.config.max_position_embeddings
    prompt = prompt_of(target, "x" * 600)[: limit - 12]
    _, _, head, truth = _setup(tiny_target, prompt_of, reference, "llama", 8, 12, prompt)
    r = generate(target, build_drafter("dflash", target, head=_forced(head, len(prompt), truth)), prompt, 12,
                 eos_token_ids=[])
    assert r.tokens == truth[:12]  # the engine cut the last block to fit position limit - 1


def test_num_draft_verifies_the_first_block_positions_only(tiny_target, prompt_of, reference):
    S, K, rounds = 8, 3, 5
    new = 1 + rounds * (K + 1)
    target, prompt, head, truth = _setup(tiny_target, prompt_of, reference, "qwen2", S, new)
    r = generate(target, build_drafter("dflash", target, head=_forced(head, len(prompt), truth), num_draft=K), prompt,
                 new, eos_token_ids=[])
    assert r.tokens == truth[:new] and r.tau == K + 1 and len(r.proposed_by_position) == K
    with_default = build_drafter("dflash", target, head=head, num_draft=None)
    assert with_default.num_draft == S - 1 and build_drafter("dflash", target, head=head, num_draft=50).num_draft == 7


def test_num_draft_above_the_block_says_so(tiny_target, capsys):
    """issue 47: num_draft=100 with a block of 8 verifies 7 per pass: one stderr line says so (none at or below 7)."""
    target = tiny_target("llama")
    head = build_dflash(target.model, block_size=8, num_layers=1)
    assert build_drafter("dflash", target, head=head, num_draft=7).num_draft == 7
    assert capsys.readouterr().err == ""
    assert build_drafter("dflash", target, head=head, num_draft=100).num_draft == 7
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "num_draft=100" in err[0] and "block_size 8" in err[0] and "7" in err[0], err


def test_min_confidence_cuts_the_block(tiny_target, prompt_of, reference):
    """A random head is unsure of every position: min_confidence 1 keeps one token per pass; a head sure of its
    block (forced, each row's probability ~1) keeps full blocks at 0.5."""
    S = 6
    target, prompt, head, truth = _setup(tiny_target, prompt_of, reference, "llama", S, 20)
    r = generate(target, build_drafter("dflash", target, head=head, min_confidence=1.0), prompt, 20, eos_token_ids=[])
    assert r.tokens == truth[:20]
    assert r.proposed_by_position == [r.verify_passes - 1]  # 1 per pass (the last pass had 1 token left to make)
    new = 1 + 3 * S
    r = generate(target, build_drafter("dflash", target, head=_forced(head, len(prompt), truth), min_confidence=0.5),
                 prompt, new, eos_token_ids=[])
    assert r.tokens == truth[:new] and r.tau == S


def test_head_and_drafter_mismatches_name_the_right_drafter(tmp_path, tiny_target):
    target = tiny_target("llama")
    torch.manual_seed(0)
    dflash = build_dflash(target.model, block_size=4)
    for drafter in ("eagle", "eagle3"):
        with pytest.raises(UserError, match="use drafter=dflash"):
            build_drafter(drafter, target, head=dflash)
    with pytest.raises(UserError, match="use drafter=eagle\\)"):
        build_drafter("dflash", target, head=build_eagle(target.model))
    with pytest.raises(UserError, match="use drafter=eagle3"):
        build_drafter("dflash", target, head=build_eagle3(target.model))
    with pytest.raises(UserError, match="not a tree"):
        build_drafter("dflash", target, head=dflash, chain=False)
    saved = str(save_head(dflash, tmp_path / "h", head_record(dflash, target.identity)))
    with pytest.raises(UserError, match="pass drafter=dflash"):
        build_drafter("eagle3", target, head=saved)
    eagle = build_eagle(target.model)
    with pytest.raises(UserError, match="pass drafter=eagle"):
        build_drafter("dflash", target, head=str(save_head(eagle, tmp_path / "e", head_record(eagle, target.identity))))
    assert build_drafter("dflash", target, head=saved).head.head_config() == dflash.head_config()
