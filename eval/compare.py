"""Trained heads side by side on held-out prompts (scripts/eval_heads.py drives it): each head's hits per prompt,
pooled into training's held-out tau with its spread over prompts (tau per block of prompts, a standard error), and
the table. The measure is this package's acceptance.py, so the figures compare with a training log's `[eval]` lines."""

from __future__ import annotations

import math
import statistics
from typing import Any

import torch
from tqdm.auto import tqdm

from selfspec.eval.acceptance import acceptance_from_hits, aux_features, chain_hits
from selfspec.registry import method


def prompt_hits(head, target, seqs: list[tuple[torch.Tensor, int]], depth: int,
                name: str) -> list[tuple[torch.Tensor, int]]:
    """Per prompt (hits, chains) of one head: as its method measures its drafts (Method.hits: a DFlash head one block
    of its own size per position, a P-EAGLE head its own depth in one pass), else a greedy chain of `depth` (an
    EAGLE-3 head reading its aux layers at step 0)."""
    own = method(head.head_type)
    if own.hits:
        measure = own.load("hits")
        return [measure(head, target, [s], depth) for s in tqdm(seqs, desc=f"drafting with {name}", leave=False)]
    features = aux_features(head, target.model) if hasattr(head, "aux_states") else None
    return [chain_hits(head, target, [s], depth, features=features)
            for s in tqdm(seqs, desc=f"rolling out {name}", leave=False)]


def first_drafts(each: list[tuple[torch.Tensor, int]], block_size: int) -> dict[str, float]:
    """tau when a block of `block_size` is drafted but only its first b-1 drafts are verified, b = 4, 8, 16 (up to
    block_size): 1 + sum over d < b of P(first d drafts accepted), from the pooled hits."""
    hits, chains = sum(h for h, _ in each), sum(c for _, c in each)
    return {str(b): round(1.0 + float(hits[:b - 1].sum()) / max(chains, 1), 3) for b in (4, 8, 16) if b <= block_size}


def summarize(each: list[tuple[torch.Tensor, int]], block: int) -> dict[str, Any]:
    """Per-prompt (hits, chains) -> tau and acceptance over all chains, tau per block of prompts, and the
    standard error of tau over prompts."""
    def pooled(group):
        return acceptance_from_hits(sum(h for h, _ in group), sum(c for _, c in group))

    per_prompt = [acceptance_from_hits(h, c)["tau"] if c else None for h, c in each]  # None: no whole chain
    taus = [t for t in per_prompt if t is not None]
    whole = pooled(each)
    return {**whole, "tau": round(whole["tau"], 3),
            "sem": round(statistics.stdev(taus) / math.sqrt(len(taus)), 3) if len(taus) > 1 else float("nan"),
            "blocks": [round(pooled(each[i:i + block])["tau"], 3) for i in range(0, len(each), block)],
            "per_prompt": [None if t is None else round(t, 3) for t in per_prompt]}


def format_table(report: dict[str, Any]) -> str:
    heads = report["heads"]
    n_blocks = max(len(h["blocks"]) for h in heads.values())
    lines = [f"held-out tau, greedy drafts (EAGLE: chain of {report['depth']}; DFlash: one block of its size), "
             f"{report['prompts']} prompts x {report['new_tokens']} tokens",
             f"{'head':<16}{'drafts':>10}{'tau':>7}{'+-sem':>7}"
             + "".join(f"{'prompts ' + str(b + 1):>11}" for b in range(n_blocks))]
    for name, h in heads.items():
        lines.append(f"{name:<16}{h.get('drafts', ''):>10}{h['tau']:>7.3f}{h['sem']:>7.3f}"
                     + "".join(f"{t:>11.3f}" for t in h["blocks"]))
    for name, h in heads.items():
        if h.get("tau_first"):
            lines.append(f"{name}: tau verifying the first b-1 drafts of each block: "
                         + ", ".join(f"b={b} {t:.3f}" for b, t in h["tau_first"].items()))
    return "\n".join(lines)
