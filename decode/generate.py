"""Generate with speculative decoding from the command line: one prompt or a JSONL file of prompts.

    python decode/generate.py head=outputs/eagle prompt="Explain KV caches."
    python decode/generate.py drafter=ngram prompts_file=prompts.jsonl output_file=out.jsonl
    python decode/generate.py drafter=draft_model draft_model=HuggingFaceTB/SmolLM2-135M-Instruct target=hf ...

Prompts files hold one JSON object per line, {"prompt": "..."} or {"messages": [{"role": ..., "content": ...}]};
the target's chat template is applied (add_generation_prompt=True) unless chat=false. A stats line follows
every prompt; output_file gets one JSON line per prompt (prompt, completion, token_ids, tau, tokens_per_s,
target_passes, ...). Everything is checked before output_file is touched; its lines go to a temp file beside it
that replaces it only once every prompt is done (core/cli.owned_output: only a file this command wrote, or
any with overwrite=true, never an input), so a failed or interrupted run leaves the
previous output_file as it was (the completions it printed are on stdout).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional


from selfspec.decode.drafters import (LookupConfig, build_drafter, check_options, drafter_for, known,
                                      lookup_options)
from selfspec.decode.engine import Result, check_fits, generate
from selfspec.core.cli import entry, owned_output
from selfspec.core.errors import SEED_MAX, UserError, check_range
from selfspec.core.ownership import Kind, json_keys
from selfspec.target.model import TargetConfig, chat_prompt_ids, load_target_from_config, pick_device
from selfspec.registry import method, names


@dataclass
class TreeConfig:
    """EAGLE-2 dynamic tree (used when chain=false)."""

    depth: int = field(default=5, metadata={"help": "Tree levels (= the longest path verified per pass)."})
    top_k: int = field(default=8, metadata={"help": "Children expanded per beam and beams kept per level."})
    total_tokens: int = field(default=32, metadata={"help": (
        "Nodes verified per target pass. GPUs use ~60; on a CPU a pass costs ~linearly in tokens, keep it small.")})


@dataclass
class GenerateConfig:
    """Schema of conf/generate.yaml."""

    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: Optional[str] = field(default=None, metadata={"help": (
        f"null = the type head= records ({', '.join(names())}); else hybrid (head= beside a lookup: "
        "see `lookup`), draft_model (needs draft_model=), ngram (prompt lookup), suffix (a suffix trie of the prompt "
        "and output), none (the target alone), or a head type naming the head's own (a mismatch is refused).")})
    head: Optional[str] = field(default=None, metadata={"help": (
        "Trained head: a folder, a single .safetensors/.pt file, or a Hub id. Refused if trained for another "
        "target.")})
    head_revision: Optional[str] = field(default=None, metadata={"help": (
        "A Hub head's branch, tag or commit (pins what `head=<user>/<name>` downloads); null = main.")})
    draft_model: Optional[str] = field(default=None, metadata={"help": (
        "drafter=draft_model: a small causal LM sharing the target's tokenizer (Hub id, folder, tiny:<family>).")})
    prompt: Optional[str] = field(default=None, metadata={"help": (
        "One prompt, or a JSONL file of prompts (see the module docstring). Exactly one of them.")})
    prompts_file: Optional[str] = field(default=None, metadata={"help": (
        "A JSONL file of prompts, one per line (see the module docstring); instead of `prompt`.")})
    chat: bool = field(default=True, metadata={"help": (
        "Apply the target's chat template to each prompt (a single user turn for `prompt`).")})
    max_new_tokens: int = field(default=256, metadata={"help": (
        "Tokens to generate per prompt (stops earlier at the target's end-of-turn token).")})
    temperature: float = field(default=0.0, metadata={"help": (
        "0 = greedy (output identical to the target's own greedy decoding). >0: sampling, exactly the target's "
        "distribution after temperature, top_k (0 = off) and top_p (1.0 = off).")})
    top_k: int = field(default=0, metadata={"help": "Sampling: keep the k most likely tokens (0 = off)."})
    top_p: float = field(default=1.0, metadata={"help": "Sampling: nucleus probability mass kept (1.0 = off)."})
    seed: int = field(default=0, metadata={"help": (
        "Seed of the sampling generator (each prompt uses seed + its index).")})
    chain: bool = field(default=True, metadata={"help": (
        "Draft a chain of num_draft tokens (true) or an EAGLE-2 tree (false, eagle only; see `tree`).")})
    num_draft: Optional[int] = field(default=None, metadata={"help": (
        "Draft tokens per verification pass (chain length); null = the drafter's own (decode/draft.NUM_DRAFT for "
        "chains, the whole block for a DFlash head, the trained depth for a P-EAGLE head).")})
    min_confidence: float = field(default=0.0, metadata={"help": (
        f"Chains ({', '.join(n for n in names() if method(n).hybrid == 'chain')}, draft_model) stop early once the "
        "product of their drafted tokens' probabilities "
        "falls below this (dynamic chain length, still lossless; 0 = always num_draft tokens).")})
    tree: TreeConfig = field(default_factory=TreeConfig)
    max_ngram: int = field(default=3, metadata={"help": (
        "drafter=ngram: longest and shortest suffix n-gram looked up in the context.")})
    min_ngram: int = field(default=1, metadata={"help": "drafter=ngram: shortest suffix n-gram looked up."})
    lookup: LookupConfig = field(default_factory=LookupConfig, metadata={"help": (
        "drafter=suffix, and drafter=hybrid's lookup beside the head (decode/drafters/hybrid.py).")})
    screened_argmax: bool = field(default=True, metadata={"help": (
        "Greedy: take the target's fp32 argmax through decode.argmax.ScreenedArgmax (bf16 screen + fp32 recheck of "
        "the few rows that could win: the same tokens, a cheaper lm_head on CPUs); false = the full fp32 lm_head.")})
    stream: bool = field(default=False, metadata={"help": "Print text as tokens are committed."})
    output_file: Optional[str] = field(default=None, metadata={"help": (
        "JSONL file of results, one line per prompt (its config goes beside it as <name>.config.yaml).")})
    overwrite: bool = field(default=False, metadata={"help": (
        "Replace an existing output_file (and its .config.yaml) that this command did not write; never an input.")})
    device: Optional[str] = field(default=None, metadata={"help": (
        "cpu, cuda, mps...; null = cuda if available, else cpu.")})


# core/ownership.py: every line holds every key a row of ours has (a line the user added with a prompt and a
# completion of their own is theirs)
RESULTS = Kind("generate output", folder=False, mine=json_keys("prompt", "completion", "token_ids", "tau",
                                                               "tokens_per_s", "target_passes", "drafter"))


def read_prompts(cfg) -> list[dict[str, Any]]:
    """-> [{"prompt": str} or {"messages": [...]}]"""
    if (cfg.prompt is None) == (cfg.prompts_file is None):
        raise UserError('pass exactly one of prompt="..." or prompts_file=F.jsonl')
    if cfg.prompt is not None:
        return [{"prompt": str(cfg.prompt)}]
    return read_prompts_file(cfg.prompts_file)


def read_prompts_file(prompts_file: str) -> list[dict[str, Any]]:
    """A JSONL file of {"prompt": ...} / {"messages": [...]} objects; one-line UserError if it is not one."""
    path = Path(prompts_file)
    if path.exists() and not path.is_file():  # a pipe would block the read until a writer came, a device never end
        raise UserError(f"prompts_file '{path}' is not a regular file (a folder, pipe or device); pass a JSONL file")
    if not path.is_file():
        raise UserError(f"prompts_file '{path}' does not exist")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"prompts_file '{path}' is not UTF-8 text ({e.reason} at byte {e.start}); re-encode it") from e
    items = []
    for i, line in enumerate(text.split("\n"), 1):  # JSONL lines end at \n only: U+2028 may sit inside a string
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{i} is not valid JSON ({e.msg})") from e
        problem = check_prompt_item(obj)
        if problem:
            raise UserError(f"{path}:{i}: {problem}")
        items.append(obj)
    if not items:
        raise UserError(f"prompts_file '{path}' holds no prompts")
    return items


def check_prompt_item(obj: Any) -> Optional[str]:
    """What is wrong with one prompts-file item, or None: {"prompt": str} or {"messages": [{role, content}, ...]}
    with string roles and contents (what a chat template can render)."""
    if not isinstance(obj, dict) or not ("prompt" in obj or "messages" in obj):
        return 'needs a "prompt" string or a "messages" list'
    if "messages" in obj:
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages:
            return '"messages" must be a non-empty list of {"role": ..., "content": ...}'
        for k, m in enumerate(messages, 1):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                return f'message {k} needs "role" and "content" strings'
    elif not isinstance(obj["prompt"], str):
        return f'"prompt" must be a string (got {type(obj["prompt"]).__name__})'
    return None


def encode(tokenizer, item: dict[str, Any], chat: bool, template: Optional[str] = None) -> list[int]:
    """A prompt's token ids: rendered with `template` (None = the tokenizer's own), or its plain text when `chat` is
    off or there is no template at all."""
    messages = item.get("messages") or [{"role": "user", "content": item["prompt"]}]
    if chat and (template or getattr(tokenizer, "chat_template", None)):
        return chat_prompt_ids(tokenizer, messages, template)
    text = item.get("prompt") or "\n".join(m["content"] for m in messages)
    return tokenizer(text)["input_ids"]


def stats_line(r: Result) -> str:
    acc = " ".join(f"{a:.2f}" for a in r.accept_by_position[:8])
    return (f"[{r.new_tokens} tokens, {r.stop_reason} | tau {r.tau:.2f} | {r.tokens_per_s:.1f} tok/s | "
            f"{r.target_passes} target passes | accept by position {acc or '-'} | "
            f"draft {r.draft_s:.2f}s verify {r.verify_s:.2f}s other {r.other_s:.2f}s]")


class _Streamer:
    """Prints the text of committed tokens as they come (decoding the whole output keeps multi-byte
    characters intact)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.shown = tokenizer, [], ""

    def __call__(self, new_ids: list[int]) -> None:
        self.ids.extend(new_ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            sys.stdout.write(text[len(self.shown):])
            sys.stdout.flush()
            self.shown = text


@entry("generate", GenerateConfig)
def main(cfg) -> list[dict[str, Any]]:
    if cfg.max_new_tokens <= 0:
        raise UserError(f"max_new_tokens must be > 0 (got {cfg.max_new_tokens})")
    if cfg.drafter is not None and cfg.drafter not in known():
        raise UserError(f"unknown drafter '{cfg.drafter}'; known: {', '.join(known())}")
    check_range("temperature", cfg.temperature, 0)
    check_range("top_p", cfg.top_p, 0, 1, low_open=True)
    check_range("top_k", cfg.top_k, 0, integer=True)
    check_range("seed", cfg.seed, 0, SEED_MAX, integer=True)
    pick_device(cfg.device)  # before loading anything: a device this machine lacks is one line
    options = dict(head=cfg.head, head_revision=cfg.head_revision, draft_model=cfg.draft_model, chain=cfg.chain,
                   num_draft=cfg.num_draft, tree_depth=cfg.tree.depth, tree_top_k=cfg.tree.top_k,
                   tree_total_tokens=cfg.tree.total_tokens, max_ngram=cfg.max_ngram, min_ngram=cfg.min_ngram,
                   min_confidence=cfg.min_confidence, **lookup_options(cfg.lookup))
    check_options(**options)  # before loading anything
    if cfg.drafter == "hybrid" and cfg.head is None and cfg.draft_model is None:
        raise UserError("drafter=hybrid needs head=<a trained head> (or draft_model=): the lookup drafts beside it")
    cfg.drafter = drafter_for(cfg.drafter, cfg.head, cfg.head_revision)  # the config saved says what ran
    inputs = [("prompts_file", cfg.prompts_file), ("head", cfg.head), ("target.name_or_path", cfg.target.name_or_path),
              ("lookup.corpus", cfg.lookup.corpus)]
    # output_file and its config checked before loading anything; the rows go to a temp file beside output_file, which
    # replaces it only when every prompt is done (output_file null: the rows are printed only)
    with owned_output(cfg, cfg.output_file or None, "output_file", RESULTS, inputs) as tmp:
        return generate_prompts(cfg, options, tmp)


def generate_prompts(cfg, options: dict[str, Any], out: Optional[Path]) -> list[dict[str, Any]]:
    """Load the target and the drafter, check every prompt, then decode them (the rows also go to `out`)."""
    items = read_prompts(cfg)
    target = load_target_from_config(cfg.target, device=pick_device(cfg.device))
    drafter = build_drafter(cfg.drafter, target, **options)
    tok = target.tokenizer
    encoded = [encode(tok, item, cfg.chat) for item in items]
    for i, ids in enumerate(encoded):  # before any output is written: a bad prompt must not leave half a file
        if not ids:
            raise UserError(f"prompt {i + 1} is empty (no tokens); remove it or give it some text")
        check_fits(target.model, len(ids), cfg.max_new_tokens, f"prompt {i + 1}")
    if out is None:
        return generate_all(cfg, target, drafter, items, encoded, None)
    with open(out, "w", encoding="utf-8") as out_f:
        return generate_all(cfg, target, drafter, items, encoded, out_f)


def generate_all(cfg, target, drafter, items, encoded, out_f) -> list[dict[str, Any]]:
    """Decode every prompt, printing each completion and its stats line; each row also goes to `out_f`."""
    tok = target.tokenizer
    rows = []
    for i, (item, ids) in enumerate(zip(items, encoded)):
        streamer = _Streamer(tok) if cfg.stream else None
        r = generate(target, drafter, ids, cfg.max_new_tokens, temperature=cfg.temperature, top_k=cfg.top_k,
                     top_p=cfg.top_p, seed=cfg.seed + i, stream_callback=streamer, screened_argmax=cfg.screened_argmax)
        completion = tok.decode(r.tokens, skip_special_tokens=True)
        print(completion if streamer is None else "")
        print(stats_line(r), flush=True)
        row = {"prompt": item.get("prompt", item.get("messages")), "completion": completion,
               "token_ids": r.tokens, "tau": round(r.tau, 4), "tokens_per_s": round(r.tokens_per_s, 3),
               "target_passes": r.target_passes, "drafter": cfg.drafter, **r.metrics()}
        rows.append(row)
        if out_f is not None:
            out_f.write(json.dumps(row) + "\n")
    return rows


if __name__ == "__main__":
    main()
