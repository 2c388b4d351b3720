"""selfspec's own engine (decode.engine.generate, fp32, greedy) as a benchmark engine, and its pass costs.

Knobs (engines/methods.py): num_draft = the chain's length (EAGLE-3) or the block positions verified (DFlash: the
draft pass always decodes the trained block); p_min = the drafters' min_confidence (the chain stops once the
product of its tokens' draft probabilities falls below it).
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch

from selfspec.engines.methods import Method, record_prompt, rotated


def drafter_for(target, m: Method, heads: dict[str, Any], lookup: Optional[dict[str, Any]] = None):
    """The decode drafter of one method (None for plain); `heads` caches the loaded head modules by path; `lookup`:
    the suffix drafter's and the hybrids' lookup options (decode.drafters.lookup_options)."""
    from selfspec.decode.drafters import build_drafter
    from selfspec.heads.checkpoint import load_head

    lookup = dict(lookup or {})
    if m.kind == "none":
        return None
    if m.kind == "ngram":
        return build_drafter("ngram", target, num_draft=m.num_draft)
    if m.kind == "suffix":
        return build_drafter("suffix", target, **lookup)
    kind = m.base if m.kind == "hybrid" else m.kind
    if m.head not in heads:
        heads[m.head] = load_head(m.head, target, expected_type=kind)
    if m.kind == "hybrid":  # the method's knobs are the head's chain beside the lookup
        lookup.update(lookup=m.lookup or lookup.get("lookup", "suffix"), hybrid_num_draft=m.num_draft,
                      hybrid_min_confidence=m.p_min)
        return build_drafter("hybrid", target, head=heads[m.head], chain=True, **lookup)
    return build_drafter(m.kind, target, head=heads[m.head], chain=True, num_draft=m.num_draft,
                         min_confidence=m.p_min)


def selfspec_rows(target, methods: list[Method], prompts: list[list[int]], max_new_tokens: int, warmup: int = 1,
                  heads: Optional[dict[str, Any]] = None, temperature: float = 0.0,
                  lookup: Optional[dict[str, Any]] = None, repeats: int = 1) -> dict[str, dict[str, Any]]:
    """Every method over every prompt, the methods taking the prompts in turn (the order rotated per prompt, as
    llama.cpp's servers), so drift hits every row alike. tau = committed / verification passes (bonus included);
    steps = passes + the prefill, step_s = their wall time; draft_s = drafting (propose + observe); per_prompt: each
    prompt's accepted drafts, verification passes (`drafts`) and passes accepting >= d drafts. temperature > 0
    samples (seed = the prompt's index: every method draws from the same stream). `repeats` > 1 decodes every prompt
    that many times per method (all prompts once, then again, the rotation going on), as llamacpp_rows: a prompt's
    seconds and counters are its runs' means, its tokens the first run's, which every later one must repeat (else it
    counts as differing: `repeats_differ`)."""
    from selfspec.core.errors import UserError
    from selfspec.decode.engine import stop_token_ids, generate

    if repeats < 1:
        raise UserError(f"repeats {repeats}: must be >= 1")
    heads = {} if heads is None else heads
    eos = stop_token_ids(target)
    drafters = {m.name: drafter_for(target, m, heads, lookup) for m in methods}
    for d in drafters.values():
        for ids in prompts[:warmup]:
            generate(target, d, ids, 8, eos_token_ids=eos)
    runs = {m.name: {"tokens": [], "seconds": [], "committed": 0.0, "passes": 0.0, "drafted": 0.0, "draft_s": 0.0,
                     "steps": 0.0, "per_prompt": [], "repeats_differ": 0} for m in methods}
    names = list(drafters)
    for rep in range(repeats):
        for j, ids in enumerate(prompts):
            for name in rotated(names, rep, j, len(prompts)):
                r = generate(target, drafters[name], ids, max_new_tokens, temperature=temperature, seed=j,
                             eos_token_ids=eos)
                _record(runs[name], j, rep == 0, r, 1 / repeats)
    rows = {}
    for m in methods:
        run = runs[m.name]
        rows[m.name] = {"tokens": run["tokens"], "seconds": run["seconds"],
                        "tau": run["committed"] / max(run["passes"], 1), "steps": run["steps"],
                        "step_s": sum(run["seconds"]), "verified_tokens": run["passes"] + run["drafted"],
                        "draft_s": run["draft_s"], "num_draft": m.num_draft, "p_min": m.p_min,
                        **({"lookup": m.lookup} if m.lookup else {}), **_leaves(drafters[m.name]),
                        "per_prompt": run["per_prompt"],
                        **({"repeats": repeats, "repeats_differ": run["repeats_differ"]} if repeats > 1 else {})}
    return rows


def _record(run: dict[str, Any], j: int, first: bool, r, share: float) -> None:
    """One decode of prompt j (decode.engine.generate's result) into its method's run, its time and counters each a
    `share` (1 / repeats) of the prompt's means; the first decode's tokens are kept, a later one's compared with them
    (engines.methods.record_prompt, which llama.cpp's served rows share)."""
    p = record_prompt(run, j, first, r.tokens, r.total_s, share,
                      {"accepted": 0.0, "drafts": 0.0, "accepted_by_position": []})
    p["accepted"] += (r.committed_by_verify - r.verify_passes) * share
    p["drafts"] += r.verify_passes * share
    by = p["accepted_by_position"]
    by += [0.0] * (len(r.accepted_by_position) - len(by))
    for d, a in enumerate(r.accepted_by_position):
        by[d] += a * share
    run["committed"] += r.committed_by_verify * share
    run["passes"] += r.verify_passes * share
    run["drafted"] += r.drafted_tokens * share
    run["draft_s"] += r.draft_s * share
    run["steps"] += r.target_passes * share


def _leaves(drafter) -> dict[str, list[int]]:
    """A hybrid row's head leaves beside its chain, as its drafter was built ({"head_siblings": [siblings, depth]};
    none where its head drafts none: a block head, a draft model, a head alone)."""
    head = getattr(drafter, "head", None)
    n, depth = getattr(head, "siblings", 0), getattr(head, "sibling_depth", 0)
    return {"head_siblings": [n, depth]} if n and depth else {}


@torch.inference_mode()
def pass_costs(target, context: list[int], Ms: list[int], drafts: dict[str, Any], repeats: int = 7) -> dict[str, Any]:
    """Milliseconds (the fastest of `repeats`: the least disturbed by other jobs) of one target pass over M new
    tokens after `context` (KV-cached; the verification pass's own code: kv.decoder_forward with the greedy argmax
    head), c1 = pass[1], and of one round's drafting per drafter in `drafts` ({name: decode drafter}): observing the
    last verified position and proposing (an EAGLE-3 chain: that observe + num_draft - 1 sequential head steps; a
    DFlash block: a context extension + one pass; P-EAGLE: one pass over the position and K-1 slots), after an untimed
    observe of the rest of the context."""
    from selfspec.decode import kv
    from selfspec.decode.draft import Sampling
    from selfspec.decode.engine import _greedy_head

    model = target.model
    device = next(model.parameters()).device
    head = _greedy_head(model, True)
    seq = torch.tensor([context], dtype=torch.long, device=device)
    P = seq.shape[1]
    layers = sorted({i for d in drafts.values() for i in (getattr(d, "feature_layers", None) or [])}) or None
    cache = kv.new_cache()
    h, _ = kv.decoder_forward(model, seq, torch.arange(P, device=device)[None], cache, None, logits_from=P - 1,
                              feature_layers=layers, head=head)

    def verify(M: int) -> float:
        ids = seq[:, P - M:]  # M tokens at positions P..P+M-1 (their values do not change the cost)
        t = time.perf_counter()
        kv.decoder_forward(model, ids, torch.arange(P, P + M, device=device)[None], cache, None, head=head)
        s = time.perf_counter() - t
        kv.truncate(cache, P)
        return s

    out: dict[str, Any] = {"context_tokens": P, "pass_ms": {}}
    for M in Ms:
        verify(M)  # warm
        out["pass_ms"][M] = round(min(verify(M) for _ in range(repeats)) * 1e3, 3)  # the least disturbed
    out["c1_ms"] = out["pass_ms"].get(1)
    sampling = Sampling(0.0, 0, 1.0, torch.Generator(device="cpu"))
    committed = torch.cat([seq, seq[:, -1:]], dim=1)  # the context + the token the prefill committed (the anchor)
    out["draft_ms"] = {}
    for name, d in drafts.items():
        own = getattr(d, "feature_layers", None)
        feats = h if own is None or own == layers else _select(h, layers, own)
        times = []
        for _ in range(repeats + 1):  # each round after a fresh, untimed observe of the context but its last position
            d.reset(seq)
            d.observe(committed, feats[:, :P - 1], 0)
            t = time.perf_counter()  # a round's drafting: observe the verified position (P-EAGLE drafts there), propose
            d.observe(committed, feats[:, P - 1:], P - 1)
            draft = d.propose(committed, 10**6, sampling)
            times.append(time.perf_counter() - t)
        out["draft_ms"][name] = {"ms": round(min(times[1:]) * 1e3, 3), "tokens": len(draft)}
    return out


def _select(h: torch.Tensor, layers: list[int], own: list[int]) -> torch.Tensor:
    """The features of `own` layers out of h = cat(features of `layers`) [1, T, len(layers) * H]."""
    H = h.shape[-1] // len(layers)
    return torch.cat([h[..., layers.index(i) * H:(layers.index(i) + 1) * H] for i in own], dim=-1)


@torch.inference_mode()
def lookup_cost(target, prompts: list[list[int]], lookup: dict[str, Any], context_tokens: int = 2048,
                rounds: int = 64, repeats: int = 5) -> dict[str, Any]:
    """What a hybrid's lookup costs per round at `context_tokens` of context, against a target step there: the suffix
    drafter (its `lookup` options) has read the context; each round appends 3 committed tokens (its incremental
    update) and proposes; ms = the median round. The step: one token after the same context, KV-cached (the fastest
    of `repeats`). Prints and returns both and their ratio."""
    import statistics

    from selfspec.decode import kv
    from selfspec.decode.drafters import build_drafter
    from selfspec.decode.draft import Sampling
    from selfspec.decode.engine import _greedy_head

    ids = [t for p in prompts for t in p]
    ids = (ids * (1 + (context_tokens + 3 * rounds) // max(len(ids), 1)))[:context_tokens + 3 * rounds]
    opts = {**lookup, "lookup_num_draft": lookup.get("lookup_num_draft")}
    drafter = build_drafter("suffix", target, **opts)
    sampling = Sampling()
    seq = torch.tensor([ids[:context_tokens]])
    drafter.reset(seq)
    drafter.propose(seq, 64, sampling)  # reads the context: the prefill's share, not a round's
    times = []
    for r in range(rounds):
        seq = torch.tensor([ids[:context_tokens + 3 * (r + 1)]])
        t = time.perf_counter()
        drafter.observe(seq, None, 0)
        drafter.propose(seq, 64, sampling)
        times.append(time.perf_counter() - t)
    model = target.model
    device = next(model.parameters()).device
    ctx = torch.tensor([ids[:context_tokens]], device=device)
    cache = kv.new_cache()
    head = _greedy_head(model, True)
    kv.decoder_forward(model, ctx, torch.arange(context_tokens, device=device)[None], cache, None,
                       logits_from=context_tokens - 1, head=head)
    steps = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        kv.decoder_forward(model, ctx[:, -1:], torch.tensor([[context_tokens]], device=device), cache, None, head=head)
        steps.append(time.perf_counter() - t)
        kv.truncate(cache, context_tokens)
    out = {"context_tokens": context_tokens, "lookup_ms": round(statistics.median(times) * 1e3, 3),
           "step_ms": round(min(steps[1:]) * 1e3, 3)}
    out["ratio"] = round(out["lookup_ms"] / out["step_ms"], 4)
    print(f"[serve-bench] the suffix lookup's round at {context_tokens} tokens of context: {out['lookup_ms']:.2f} ms, "
          f"{out['ratio']:.3f} of a target step ({out['step_ms']:.1f} ms)", flush=True)
    return out
