"""Self-speculative LayerSkip decoding (methods/layerskip/drafter.py) is lossless while it shares the target's
KV cache: greedy output identical to the target's on 4-layer tiny llama / qwen2 / gemma3 targets (past gemma3's
sliding window), exact tau for an oracle exit (E = L) and an always-wrong one, exact sampling (chi-square)."""

from __future__ import annotations

import functools

import pytest
import torch

from selfspec.decode.drafters import build_drafter
from selfspec.decode.engine import generate
from selfspec.methods.layerskip.head import build_layerskip
from selfspec.target.model import load_target
from sampling_stats import chi_square_pvalue, exact_joint, sampled_first_three

LAYERS, NEW = 4, 90


@functools.lru_cache(maxsize=None)
def _target(family: str):
    return load_target(f"tiny:{family}", tiny={"num_hidden_layers": LAYERS})


def _fresh(family: str):  # LoRA exits inject into the target: never into the shared one
    return load_target(f"tiny:{family}", tiny={"num_hidden_layers": LAYERS})


def _prompt(target, text="Tell me about speculative decoding, briefly.") -> list[int]:
    ids = target.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                               tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@functools.lru_cache(maxsize=None)
def _reference(family: str, prompt: tuple[int, ...], new: int) -> list[int]:
    model = _target(family).model
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _trained_like(head):
    """Random (nonzero) adapter weights: a partly-right exit, so drafts are both accepted and rejected."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in head.trainable_parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return head


CASES = {
    "light_chain": ({"adapter": "light", "rank": 8}, {"num_draft": 4}),
    "light_tree": ({"adapter": "light", "rank": 8}, {"chain": False, "tree_depth": 3, "tree_top_k": 3}),
    "layer_chain": ({"adapter": "layer"}, {"num_draft": 3}),
    "layer_tree": ({"adapter": "layer"}, {"chain": False, "tree_depth": 2, "tree_top_k": 2}),
    "lora_chain": ({"adapter": "lora", "lora_rank": 4}, {"num_draft": 3}),
    "small_vocab": ({"adapter": "light", "rank": 8, "vocab_size": 64}, {"num_draft": 4}),
}


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_identical_to_target(family, case):
    head_kw, drafter_kw = CASES[case]
    target = _fresh(family) if head_kw["adapter"] == "lora" else _target(family)
    if "vocab_size" in head_kw:
        head_kw = {**head_kw, "draft_vocab": torch.randperm(256, generator=torch.Generator().manual_seed(0))[:64]}
    head = _trained_like(build_layerskip(target.model, exit_layer=2, **head_kw))
    prompt = _prompt(target)
    drafter = build_drafter("layerskip", target, head=head, **drafter_kw)
    r = generate(target, drafter, prompt, NEW, eos_token_ids=[])
    assert r.tokens == _reference(family, tuple(prompt), NEW)
    assert len(prompt) + NEW > 64  # gemma3's sliding window is exercised
    assert r.committed_by_verify == NEW - 1 and r.tau == (NEW - 1) / r.verify_passes  # the prefill made one


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("chain", [True, False])
def test_oracle_exit_at_the_last_layer_accepts_everything(family, chain):
    """E = L with an untrained light adapter IS the target: tau = K + 1 exactly, verification runs no layer."""
    target = _target(family)
    prompt = _prompt(target)
    K, rounds = 3, 10
    new = 1 + rounds * (K + 1)
    kw = {"num_draft": K} if chain else {"chain": False, "tree_depth": K, "tree_top_k": 2}
    r = generate(target, build_drafter("layerskip", target, exit_layer=LAYERS, **kw), prompt, new, eos_token_ids=[])
    assert r.tokens == _reference(family, tuple(prompt), new)
    assert r.tau == K + 1 and r.verify_passes == rounds and r.accept_by_position == [1.0] * K


def test_always_wrong_exit_tau_is_one_and_text_right():
    target = _target("llama")
    prompt = _prompt(target)
    ref = _reference("llama", tuple(prompt), 40)
    never = next(i for i in range(255, 0, -1) if i not in ref)
    head = build_layerskip(target.model, exit_layer=2)
    vocab = target.model.get_output_embeddings().weight.shape[0]
    head.logits = lambda z: torch.nn.functional.one_hot(torch.full(z.shape[:-1], never), vocab).float() * 9.0
    r = generate(target, build_drafter("layerskip", target, head=head, num_draft=4), prompt, 40, eos_token_ids=[])
    assert r.tokens == ref
    assert r.tau == 1.0 and r.accept_by_position == [0.0] * 4


# ------------------------------------------------------------------------------------------------ sampling

T, TOP_K, RUNS = 1.0, 3, 300


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_sampling_matches_target_distribution(mode):
    target = _target("llama")
    prompt = _prompt(target, "abcabcabc")
    head = build_layerskip(target.model, exit_layer=3)  # an untrained exit: partly right, p != q
    kw = {"num_draft": 2} if mode == "chain" else {"chain": False, "tree_depth": 2, "tree_top_k": 2}
    drafter = build_drafter("layerskip", target, head=head, **kw)
    counts, accepted = sampled_first_three(target, drafter, prompt, RUNS, T, TOP_K)
    assert chi_square_pvalue(counts, exact_joint(target.model, prompt, T, TOP_K), RUNS) > 1e-3
    assert accepted > RUNS // 10  # drafts are really accepted (and rejected) here
