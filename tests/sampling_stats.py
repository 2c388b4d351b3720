"""Shared by the sampling tests: the target's exact distribution over its first three generated tokens, a
chi-square p-value of observed counts against it, and a draft model close to the target."""

from __future__ import annotations

import copy
from collections import Counter

import torch

from selfspec.decode.verify import probs


def exact_joint(model, prompt: list[int], temperature: float, top_k: int = 0,
                top_p: float = 1.0) -> dict[tuple[int, int, int], float]:
    """q(t1) q(t2 | t1) q(t3 | t1, t2) with the engine's processing (uncached full forwards)."""

    def q(ctx):
        return probs(model(torch.tensor([ctx])).logits[0, -1], temperature, top_k, top_p)

    joint, q1 = {}, q(prompt)
    for a in q1.nonzero().flatten().tolist():
        q2 = q(prompt + [a])
        for b in q2.nonzero().flatten().tolist():
            q3 = q(prompt + [a, b])
            for c in q3.nonzero().flatten().tolist():
                joint[(a, b, c)] = float(q1[a] * q2[b] * q3[c])
    return joint


def chi_square_pvalue(counts: Counter, expected: dict, n: int) -> float:
    """Pearson chi-square; cells expected below 5 are pooled into one; a sequence outside the target's
    support fails outright."""
    assert sum(v for k, v in counts.items() if k not in expected) == 0, "a sequence the target cannot produce"
    stat, dof, pool_obs, pool_exp = 0.0, -1, 0, 0.0
    for cell, p in expected.items():
        e = p * n
        if e < 5:
            pool_obs, pool_exp = pool_obs + counts[cell], pool_exp + e
            continue
        stat, dof = stat + (counts[cell] - e) ** 2 / e, dof + 1
    if pool_exp > 0:
        stat, dof = stat + (pool_obs - pool_exp) ** 2 / pool_exp, dof + 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def perturbed_draft(model, scale: float = 0.6, seed: int = 123):
    """A draft model close to the target but not equal (noise on its lm_head): accepted often, not always (p != q)."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    w = draft.get_output_embeddings().weight
    if draft.config.tie_word_embeddings:
        draft.get_output_embeddings().weight = torch.nn.Parameter(w.detach().clone(), requires_grad=False)
        w = draft.get_output_embeddings().weight
    with torch.no_grad():
        w.add_(torch.randn(w.shape, generator=g) * w.std() * scale)
    return draft


def sampled_first_three(target, drafter, prompt: list[int], runs: int, temperature: float,
                        top_k: int = 0) -> tuple[Counter, int]:
    """Decode 4 tokens `runs` times (seeds 0..runs-1) with `drafter`: how often each first-three-token sequence came
    out (for chi_square_pvalue against exact_joint), and the draft tokens accepted over all runs."""
    from selfspec.decode.engine import generate

    counts: Counter = Counter()
    accepted = 0
    for seed in range(runs):
        r = generate(target, drafter, prompt, 4, temperature=temperature, top_k=top_k, seed=seed, eos_token_ids=[])
        counts[tuple(r.tokens[:3])] += 1
        accepted += sum(r.accepted_by_position)
    return counts, accepted
