"""vLLM's CPU build as a benchmark engine: one offline `LLM` per configuration, in the worker of target/vllm_worker.py.

This file owns what is serving-specific: each method's speculative_config (none, ngram, suffix, or a head type's: its
registry entry), the measurement (greedy generation of the prompts, one request at a time, after a warm-up; seconds per
prompt and vLLM's spec-decode counters, deltas over the measured prompts) and the benchmark row. With `costs` (a plain
run: its LLM is started once for both) it then measures the target's pass costs, prefix caching on: c(1) from decode
steps, and a request whose prompt is a cached context of `context_tokens` plus M new tokens, for each M (the pass over M
tokens plus the per-request overhead, which the M=1 request measures).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from selfspec.registry import method as registered
from selfspec.target.vllm_worker import VllmWorker


def suffix_knobs(depth: int, min_prob: float, alpha: float) -> dict:
    """vLLM's suffix-decoding keys for selfspec's suffix knobs (decode/drafters LookupConfig), so both engines' suffix
    rows draft alike: the trie's depth, the lowest path probability drafted, the draft depth per matched token. No
    global tree of earlier responses (max_cached_requests 0): each request drafts from its own prompt and output, as
    selfspec's suffix row does without a corpus (a cached tree would also hold the warm-up's answer to the first
    prompt)."""
    return {"suffix_decoding_max_tree_depth": depth, "suffix_decoding_min_token_prob": min_prob,
            "suffix_decoding_max_spec_factor": alpha, "suffix_decoding_max_cached_requests": 0}


def speculative_config(method: str, draft: Optional[str], num_speculative_tokens: int,
                       suffix: Optional[dict] = None) -> Optional[dict]:
    """vLLM's speculative_config of a method: ngram (prompt lookup, no draft model), suffix (SuffixDecoding,
    Arctic Inference's suffix trees; `suffix`: suffix_knobs, vLLM's defaults when None; num_speculative_tokens
    caps each draft), a head type with the exported head folder `draft` (the method of the type's name, or what
    its registry entry's `vllm` says), none (plain)."""
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": num_speculative_tokens,
                "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    if method == "suffix":
        return {"method": "suffix", "num_speculative_tokens": num_speculative_tokens, **(suffix or {})}
    if draft:
        return {"method": method, **registered(method).vllm, "model": draft,
                "num_speculative_tokens": num_speculative_tokens}
    return None


def _timed_rows(worker: VllmWorker, prompts, max_new_tokens: int) -> dict:
    """Greedy tokens and vLLM's seconds per prompt (one request each, after a warm-up), with the spec-decode counters
    each request added, and their sum over the measured requests."""
    worker.request("generate", prompts=prompts[:1], max_tokens=8)  # warm-up
    first = before = worker.request("spec_metrics")["metrics"]
    rows = []
    for ids in prompts:
        r = worker.request("generate", prompts=[ids], max_tokens=max_new_tokens)
        after = worker.request("spec_metrics")["metrics"]
        rows.append({"tokens": r["tokens"][0], "seconds": r["seconds"],
                     "spec": {k: _minus(after[k], before.get(k)) for k in after}})
        before = after
    return {"rows": rows, "spec_metrics": {k: _minus(before[k], first.get(k)) for k in before}}


def _minus(a, b):
    if b is None:
        return a
    return [x - y for x, y in zip(a, b)] if isinstance(a, list) else a - b


def _pass_costs(worker: VllmWorker, prompts, Ms, context_tokens: int, repeats: int, decode_tokens: int) -> dict:
    """The target's pass costs in ms, from vLLM's seconds (the fastest of `repeats`: the least disturbed by other
    jobs) of max_tokens=1 requests over a cached context of `context_tokens` plus M new tokens (per M), and of one
    decode step (a request generating 1 + `decode_tokens` tokens minus one generating 1, over decode_tokens).

    c1 = one decode step; pass[M] = c1 + request(M) - request(1) (its M=1 request is one pass plus the per-request
    overhead a decode step does not pay). vLLM computes logits at the last position only in such a request, a
    verification pass at all M (the lm_head rows of M-1 positions are left out, as in llama-bench's prompt
    processing)."""
    P, longest = context_tokens, context_tokens + max(Ms) + repeats
    ids = [t for p in prompts for t in p]
    ids = (ids * (1 + longest // max(len(ids), 1)))[:longest]

    def timed(prompt: list[int], max_tokens: int = 1) -> float:
        return worker.request("generate", prompts=[prompt], max_tokens=max_tokens, ignore_eos=True)["seconds"]

    timed(ids[:P])  # caches the context's full blocks
    # each repeat a different tail (a tail never fills a block, so it is never reused)
    request = {M: min(timed(ids[:P] + ids[P + r: P + r + M]) for r in range(repeats)) for M in sorted(Ms)}
    n = max(repeats // 2, 1)
    step = (min(timed(ids[:P + 1], 1 + decode_tokens) for _ in range(n))
            - min(timed(ids[:P + 1]) for _ in range(n))) / decode_tokens
    c1, req = step * 1e3, {M: s * 1e3 for M, s in request.items()}
    return {"c1_ms": round(c1, 3), "pass_ms": {M: round(c1 + req[M] - req[min(req)], 3) for M in req},
            "request_ms": {M: round(v, 3) for M, v in req.items()}, "context_tokens": P}


def run_vllm(cfg, cache: Path, work: Path, name: str, target_folder: str, draft, prompts, method: str = "eagle",
             dtype: str = "float32", costs: Optional[dict] = None, suffix: Optional[dict] = None) -> dict:
    """One vLLM configuration in the vLLM venv (`cfg`: vllm_python, max_new_tokens, num_speculative_tokens,
    max_model_len; `cache`: vLLM's cache folder, `work`: where its log goes): method none (plain), a head type
    (`draft`: the exported head folder), ngram or suffix (`suffix`: its knobs). Its tokens, seconds per
    prompt, and tau from vLLM's own
    spec-decode counters (+ drafts = verification steps that carried a draft, accepted tokens, accepted share per
    position); with `costs` ({Ms, context_tokens, repeats, decode_tokens}) also the target's pass costs
    (`pass_costs`)."""
    log = work / f"{name.replace(' ', '_')}.log"
    print(f"[vllm] {name}: starting vLLM (log {log}) ...", flush=True)
    # prefix caching: vLLM's default, and what the pass costs need (the context is computed once)
    with VllmWorker(cfg.vllm_python, target_folder, cfg.max_model_len, dtype=dtype, prefix_caching=True, log=log,
                    speculative=speculative_config(method, draft, cfg.num_speculative_tokens, suffix),
                    cache=cache) as w:
        out = _timed_rows(w, prompts, cfg.max_new_tokens)
        pass_costs = _pass_costs(w, prompts, **costs) if costs else None
    rows = {"tokens": [r["tokens"] for r in out["rows"]], "seconds": [r["seconds"] for r in out["rows"]],
            "extra": {"start_s": round(w.start_s, 1)},
            "per_prompt": [{"accepted": r["spec"].get("vllm:spec_decode_num_accepted_tokens") or 0,
                            "drafts": r["spec"].get("vllm:spec_decode_num_drafts") or 0,
                            "accepted_by_position": r["spec"].get("vllm:spec_decode_num_accepted_tokens_per_pos")}
                           for r in out["rows"]]}
    m = out["spec_metrics"]
    drafts = m.get("vllm:spec_decode_num_drafts")
    if drafts:
        accepted = m.get("vllm:spec_decode_num_accepted_tokens")
        rows["tau"] = 1 + accepted / drafts  # vLLM's mean acceptance length: bonus token included
        rows["extra"].update(drafts=drafts, accepted=accepted, draft_tokens=m.get("vllm:spec_decode_num_draft_tokens"),
                             accepted_per_pos=[round(x / drafts, 3) for x in
                                               m.get("vllm:spec_decode_num_accepted_tokens_per_pos") or []])
    else:
        rows["tau"] = 1.0 if method == "none" else None
    if pass_costs:
        rows["pass_costs"] = pass_costs
    return rows


def vllm_rows(vllm_python: str, cache: Path, work: Path, target_folder: str, prompts, dtype: str, m,
              max_new_tokens: int, max_model_len: int = 2048, costs: Optional[dict] = None,
              suffix: Optional[dict] = None) -> dict:
    """One method (engines/methods.py Method: plain, a head type with its exported head folder, ngram, suffix with
    its knobs `suffix`) as a benchmark row: tokens, seconds, tau, and steps = verification steps of every kind
    (generated tokens - accepted drafts), step_s = their wall time (per-request overhead and prefill included),
    verified_tokens; with `costs` (run_vllm) the target's pass costs measured by the same LLM."""
    from types import SimpleNamespace

    cfg = SimpleNamespace(vllm_python=vllm_python, max_new_tokens=max_new_tokens,
                          num_speculative_tokens=max(m.num_draft, 1), max_model_len=max_model_len)
    r = run_vllm(cfg, cache, work, f"vllm-{dtype}-{m.name.replace(' ', '_')}-n{m.num_draft}", target_folder, m.head,
                 prompts, m.kind, dtype, costs, suffix)
    c = r["extra"]
    n = sum(len(t) for t in r["tokens"])
    accepted = c.get("accepted") or 0
    tps = n / max(sum(r["seconds"]), 1e-9)
    print(f"[vllm] {dtype} {m.name} {m.knobs}: {tps:.2f} tok/s, tau {r['tau']}", flush=True)
    row = {"tokens": r["tokens"], "seconds": r["seconds"], "tau": r["tau"], "start_s": c["start_s"],
           "num_draft": m.num_draft, "p_min": 0.0, "steps": n - accepted, "step_s": sum(r["seconds"]),
           "verified_tokens": n - accepted + (c.get("draft_tokens") or 0),
           "counters": {k: c[k] for k in ("drafts", "draft_tokens", "accepted", "accepted_per_pos") if k in c},
           "per_prompt": r["per_prompt"]}
    if "pass_costs" in r:
        row["pass_costs"] = r["pass_costs"]
    return row
