"""Dynamic chain length (min_confidence, decode/draft.py): chains stop once the product of their drafted tokens'
probabilities falls below the threshold. Lossless under greedy decoding (token-identical to the target) and under
sampling (chi-square against the target's exact joint, with a draft model whose drafts really are accepted)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from selfspec.decode.drafters import build_drafter
from selfspec.decode.drafters.draft_model import DraftModelDrafter
from selfspec.decode.engine import generate
from selfspec.methods.eagle.head import build_eagle
from sampling_stats import chi_square_pvalue, exact_joint, perturbed_draft

NEW = 60


def _drafter(kind, target, K, min_confidence):
    vocab = target.model.get_output_embeddings().weight.shape[0]
    if kind == "draft_model":
        return DraftModelDrafter(perturbed_draft(target.model, 0.3, seed=7), vocab, num_draft=K,
                                 min_confidence=min_confidence)
    torch.manual_seed(0)
    return build_drafter("eagle", target, head=build_eagle(target.model), num_draft=K, min_confidence=min_confidence)


# thresholds at which these drafters' chains take several lengths on this prompt (random heads are confident)
CASES = {("draft_model", "llama"): 0.02, ("draft_model", "qwen2"): 0.02, ("eagle", "llama"): 0.5,
         ("eagle", "gemma3"): 0.02}


@pytest.mark.parametrize("kind,family", list(CASES))
def test_greedy_identical_with_chains_of_several_lengths(kind, family, tiny_target, prompt_of, reference):
    target = tiny_target(family)
    prompt = prompt_of(target)
    K = 4
    r = generate(target, _drafter(kind, target, K, CASES[kind, family]), prompt, NEW, eos_token_ids=[])
    assert r.tokens == reference(family, prompt, NEW)
    reached = r.proposed_by_position + [0] * (K - len(r.proposed_by_position))  # passes whose draft reached depth d
    lengths = [reached[d] - (reached[d + 1] if d + 1 < K else 0) for d in range(K)]  # passes drafting d + 1 tokens
    assert sum(n > 0 for n in lengths) >= 2


def test_zero_threshold_always_drafts_the_full_chain(tiny_target, prompt_of):
    target = tiny_target("llama")
    r = generate(target, _drafter("draft_model", target, 3, 0.0), prompt_of(target), 30, eos_token_ids=[])
    assert r.proposed_by_position[2] >= r.proposed_by_position[0] - 1  # all full (the last may hit max_new_tokens)
    r = generate(target, _drafter("draft_model", target, 3, 1.01), prompt_of(target), 30, eos_token_ids=[])
    assert r.proposed_by_position[0] >= r.verify_passes - 1 and sum(r.proposed_by_position[1:]) == 0  # 1 per pass


@pytest.mark.parametrize("min_confidence", [0.25, 0.6])
def test_sampling_matches_target_distribution(min_confidence, tiny_target, prompt_of):
    T, TOP_K, RUNS = 1.0, 3, 400
    target = tiny_target("llama")
    prompt = prompt_of(target, "abcabcabc")
    d = _drafter("draft_model", target, 3, min_confidence)
    counts: Counter = Counter()
    lengths: Counter = Counter()
    accepted = 0
    for seed in range(RUNS):
        r = generate(target, d, prompt, 4, temperature=T, top_k=TOP_K, seed=seed, eos_token_ids=[])
        counts[tuple(r.tokens[:3])] += 1
        accepted += sum(r.accepted_by_position)
        lengths[sum(1 for p in r.proposed_by_position if p)] += 1
    assert chi_square_pvalue(counts, exact_joint(target.model, prompt, T, TOP_K), RUNS) > 1e-3
    assert accepted > RUNS // 4 and len(lengths) > 1  # drafts are accepted, and chains of several lengths occur
