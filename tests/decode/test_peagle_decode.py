"""P-EAGLE drafting in the engine (methods/peagle/drafter.py): with the drafts forced to the target's own tokens every
depth is accepted (tau = K + 1), partly right drafts keep only what was verified, and the drafter/head mismatches and
num_draft above the trained depth are one-line errors."""

import pytest
import torch

from selfspec.core.errors import UserError
from selfspec.decode.drafters import build_drafter
from selfspec.decode.engine import generate
from selfspec.heads.checkpoint import head_record, save_head
from selfspec.methods.eagle3.head import build_eagle3
from selfspec.methods.peagle.head import build_peagle


def _forced(drafter, prompt_len: int, truth: list[int], right=None):
    """Patch the head's logits: one-hot rows of `truth` (the target's greedy continuation) at each depth of the pass
    that follows the last observe, wrong from depth right(length) on. The real head pass still runs in observe."""
    head, real_observe, real_logits = drafter.head, drafter.observe, drafter.head.logits
    committed = {}

    def observe(seq, features, start):
        real_observe(seq, features, start)
        committed["n"] = start + features.shape[1] + 1  # tokens committed: depth 1 drafts position n

    def logits(hidden):
        out = torch.full_like(real_logits(hidden), -30.0)  # [K, V]
        good = out.shape[0] if right is None else right(committed["n"])
        for d in range(out.shape[0]):
            i = committed["n"] + d - prompt_len
            tok = truth[i] if i < len(truth) else 0
            out[d, tok if d < good else (tok + 1) % out.shape[-1]] = 0.0
        return out

    drafter.observe, head.logits = observe, logits
    return drafter


def _setup(tiny_target, prompt_of, family, depth, num_layers=1):
    target = tiny_target(family)
    torch.manual_seed(0)
    head = build_peagle(target.model, depth=depth, num_layers=num_layers)
    return target, prompt_of(target), head


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("K", [2, 4, 7])
def test_forced_drafts_give_tau_k_plus_one(family, K, tiny_target, prompt_of, reference):
    target, prompt, head = _setup(tiny_target, prompt_of, family, K)
    rounds = 6
    new = 1 + rounds * (K + 1)
    truth = reference(family, prompt, new + K)
    r = generate(target, _forced(build_drafter("peagle", target, head=head), len(prompt), truth), prompt, new,
                 eos_token_ids=[])
    assert r.tokens == truth[:new]
    assert r.tau == K + 1 and r.verify_passes == rounds and r.accept_by_position == [1.0] * K


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_partly_right_drafts_keep_only_verified_context(family, tiny_target, prompt_of, reference):
    target, prompt, head = _setup(tiny_target, prompt_of, family, 5, num_layers=2)
    new = 40
    truth = reference(family, prompt, new + 5)
    drafter = _forced(build_drafter("peagle", target, head=head), len(prompt), truth, right=lambda n: n % 6)
    r = generate(target, drafter, prompt, new, eos_token_ids=[])
    assert r.tokens == truth[:new]
    assert 1 < r.tau < 6


def test_num_draft_and_mismatches_are_one_line_errors(tmp_path, tiny_target):
    target = tiny_target("llama")
    torch.manual_seed(0)
    head = build_peagle(target.model, depth=3)
    assert build_drafter("peagle", target, head=head).num_draft == 3
    assert build_drafter("peagle", target, head=head, num_draft=2).num_draft == 2
    with pytest.raises(UserError, match=r"num_draft=4 is more than this P-EAGLE head drafts per pass"):
        build_drafter("peagle", target, head=head, num_draft=4)
    with pytest.raises(UserError, match="num_draft must be >= 1"):
        build_drafter("peagle", target, head=head, num_draft=0)
    with pytest.raises(UserError, match="not a tree"):
        build_drafter("peagle", target, head=head, chain=False)
    for drafter in ("eagle", "eagle3", "dflash"):
        with pytest.raises(UserError, match="use drafter=peagle"):
            build_drafter(drafter, target, head=head)
    with pytest.raises(UserError, match="use drafter=eagle3"):
        build_drafter("peagle", target, head=build_eagle3(target.model))
    saved = str(save_head(head, tmp_path / "h", head_record(head, target.identity)))
    with pytest.raises(UserError, match="pass drafter=peagle"):
        build_drafter("eagle3", target, head=saved)
    assert build_drafter("peagle", target, head=saved).head.head_config() == head.head_config()
