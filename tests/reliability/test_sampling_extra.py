"""Exact speculative SAMPLING where tests/decode/test_sampling_exact.py does not look: EAGLE-3 heads (chain and
tree), and full logits processing (temperature 2 with top-k AND top-p) on Gemma3 (soft-capped logits) with a
draft model whose p != q, a full-vocabulary EAGLE chain and a multi-draft (i.i.d. siblings) tree. Chi-square of
the first three generated tokens over fixed seeds against the exact joint computed from the target itself."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch

from selfspec.decode.drafters import build_drafter
from selfspec.decode.drafters.draft_model import DraftModelDrafter
from selfspec.decode.engine import generate
from selfspec.methods.eagle.head import build_eagle
from selfspec.methods.eagle3.head import build_eagle3
from selfspec.target.model import load_target
from sampling_stats import chi_square_pvalue, exact_joint

RUNS = 300


def _perturbed(model, scale=0.5):
    """A draft model near the target, not equal to it (partial acceptance, p != q)."""
    draft = copy.deepcopy(model)
    w = draft.get_output_embeddings().weight
    if draft.config.tie_word_embeddings:
        draft.get_output_embeddings().weight = torch.nn.Parameter(w.detach().clone(), requires_grad=False)
        w = draft.get_output_embeddings().weight
    with torch.no_grad():
        w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(7)) * w.std() * scale)
    return draft


def _setup(name):
    """-> (target, drafter, temperature, top_k, top_p)"""
    if name.startswith("eagle3"):
        target = load_target("tiny:llama")
        torch.manual_seed(0)
        head = build_eagle3(target.model, vocab_size=64, draft_vocab=torch.arange(64) + 64)
        opts = {"num_draft": 2} if name == "eagle3_chain" else \
            {"chain": False, "tree_depth": 2, "tree_top_k": 3, "tree_total_tokens": 6}
        return target, build_drafter("eagle3", target, head=head, **opts), 1.0, 3, 1.0
    target = load_target("tiny:gemma3", tiny={"sliding_window": 4})
    vocab = target.model.get_output_embeddings().weight.shape[0]
    torch.manual_seed(0)
    drafter = {
        "gemma3_draft_model": lambda: DraftModelDrafter(_perturbed(target.model), vocab, num_draft=3),
        "gemma3_eagle_full_vocab": lambda: build_drafter("eagle", target, head=build_eagle(target.model), num_draft=2),
        "gemma3_oracle_iid_tree": lambda: build_drafter("oracle", target, num_draft=2, width=3, sampled=True),
    }[name]()
    return target, drafter, 2.0, 5, 0.8  # both top-k and top-p cut: 10 possible 3-token starts


@pytest.mark.parametrize("name", ["eagle3_chain", "eagle3_tree", "gemma3_draft_model", "gemma3_eagle_full_vocab",
                                  "gemma3_oracle_iid_tree"])
def test_sampling_is_the_target_distribution(name):
    torch.set_num_threads(1)
    target, drafter, temperature, top_k, top_p = _setup(name)
    prompt = [5, 17, 99, 5, 17, 99, 5, 17]  # a pattern: prompt lookup and the drafts find something to propose
    counts, accepted = Counter(), 0
    for seed in range(RUNS):
        r = generate(target, drafter, prompt, 4, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                     eos_token_ids=[])
        counts[tuple(r.tokens[:3])] += 1
        accepted += sum(r.accepted_by_position)
    expected = exact_joint(target.model, prompt, temperature, top_k, top_p)
    assert chi_square_pvalue(counts, expected, RUNS) > 1e-3
    if name in ("gemma3_draft_model", "gemma3_oracle_iid_tree"):
        assert accepted > RUNS // 4  # drafts are really accepted (and, p != q, sometimes rejected)
