"""Held-out tau of trained heads side by side, on more prompts than training's eval, with its spread.

    python scripts/eval_heads.py data=smollm2_regen_all +heads.shipped=heads/pretrained/smollm2-135m-eagle \
        +heads.demo=outputs/demo/eagle/head [prompts=48] [new_tokens=96] [depth=5]
    python scripts/eval_heads.py target=qwen2.5-coder-1.5b suite=humaneval +heads.c3=outputs/qwen/eagle3/head \
        prompts=12 new_tokens=64 depth=4          # held-out tau on code: a standard suite's first turns

The measure is training's held-out eval (selfspec.eval.acceptance.chain_acceptance, from per-prompt chain_hits:
greedy chain of `depth` drafts, the head rolled out on its own predictions against the target's greedy
continuation of each prompt), so its figures compare with the `[eval]` lines of a training log. DFlash heads are
scored as their training scores them (block_hits: one block of the head's own size drafted at every position, tau =
1 + its accepted prefix; `depth` does not apply to them). Prompts are data.heldout_prompts: held-out
conversations whose opening does not also open a training conversation; or, with `suite=` (humaneval, mt_bench), the
first user turns of a standard suite's questions (data/suites.py: they never feed training), taken round-robin over its
categories. Twelve
prompts (training's default) leave tau a few tenths uncertain, hence more prompts here, tau per block of `block`
prompts, and a standard error over prompts. Prints a table and one JSON object on the last line; writes it to
`output_file` when set (atomically: a failed run leaves a previous file as it was; every option is checked first;
only over a report this command wrote unless overwrite=true, and never over an input: core/ownership.py).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from tqdm.auto import tqdm

from selfspec.data.config import DataConfig
from selfspec.core.cli import entry, owned_output
from selfspec.core.errors import UserError
from selfspec.core.ownership import Kind, json_keys
from selfspec.data.suites import suite_names
from selfspec.target.model import TargetConfig, load_target_from_config
from selfspec.eval.acceptance import data_template, greedy_continuations
from selfspec.eval.compare import first_drafts, format_table, prompt_hits, summarize
from selfspec.heads.checkpoint import lineage_seconds
from selfspec.registry import method, names


@dataclass
class EvalHeadsConfig:
    """Schema of conf/eval_heads.yaml."""

    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig, metadata={"help": (
        "Where the held-out prompts come from (its held-out split, minus openings its training split also has).")})
    heads: dict[str, str] = field(default_factory=dict, metadata={"help": (
        "{name: head folder or file}: +heads.NAME=PATH on the command line.")})
    head_revision: Optional[str] = field(default=None, metadata={"help": (
        "A Hub head's branch, tag or commit (for every entry of heads); null = main.")})
    suite: Optional[str] = field(default=None, metadata={"help": (
        "Score on a standard suite's first turns instead of data's held-out split: humaneval or mt_bench "
        "(data/suites.py; null = the held-out split).")})
    prompts: int = field(default=48, metadata={"help": "held-out prompts (suite questions with suite=)"})
    new_tokens: int = field(default=96, metadata={"help": (
        "greedy tokens the target writes after each prompt (the text the heads are scored on)")})
    depth: int = field(default=5, metadata={"help": "drafts per chain"})
    block: int = field(default=12, metadata={"help": (
        "tau per block of this many prompts (training's eval reads the first block)")})
    output_file: Optional[str] = field(default=None, metadata={"help": (
        "Also write the JSON here (its .config.yaml goes beside it).")})
    overwrite: bool = field(default=False, metadata={"help": (
        "Replace an existing output_file or config there that this command did not write (never an input).")})


REPORT = Kind("held-out tau report", folder=False, mine=json_keys("prompts", "depth", "heads"))  # core/ownership.py


def inputs(cfg) -> list[tuple[str, object]]:
    return [*((f"heads.{name}", path) for name, path in cfg.heads.items()), ("data.path", cfg.data.path)]


@entry("eval_heads", EvalHeadsConfig)
@torch.inference_mode()
def main(cfg) -> dict[str, Any]:
    if not cfg.heads:
        raise UserError("no heads to evaluate: pass +heads.NAME=PATH (one or more)")
    for name in ("prompts", "new_tokens", "depth", "block"):
        if getattr(cfg, name) < 1:
            raise UserError(f"{name} must be >= 1 (got {getattr(cfg, name)})")
    if cfg.suite is not None and len(suite_names(cfg.suite)) != 1:  # an unknown name raises there; `all` is two
        raise UserError(f"suite must name one suite here (humaneval or mt_bench), got '{cfg.suite}'")
    # every output checked before anything is loaded; output_file null: the report is printed only
    with owned_output(cfg, cfg.output_file or None, "output_file", REPORT, inputs(cfg)) as tmp:
        report = heldout_tau(cfg)
        if tmp is not None:
            tmp.write_text(json.dumps(report, indent=1, default=str) + "\n", encoding="utf-8")
    print(json.dumps(report), flush=True)
    return report


def heldout_tau(cfg) -> dict[str, Any]:
    """Load the target and the heads, score each on the held-out continuations; print the table."""
    from selfspec.data.tokenize import heldout_prompts
    from selfspec.decode.engine import max_positions
    from selfspec.heads.checkpoint import load_head

    t0 = time.time()
    target = load_target_from_config(cfg.target)
    heads = {name: load_head(path, target, revision=cfg.head_revision).eval() for name, path in cfg.heads.items()}
    # a head is scored by its method's own measure (Method.hits: blocks, parallel drafts) or as a chain it drafts
    # the EAGLE way (hybrid="chain"); a LayerSkip exit has neither (scripts/sweep_exit.py measures exits)
    scored = [n for n in names() if method(n).hits or method(n).hybrid == "chain"]
    for name, head in heads.items():
        if head.head_type not in scored:
            raise UserError(f"head '{name}' is a {head.head_type} head; this eval scores {', '.join(scored)} heads "
                            "(LayerSkip exits: scripts/sweep_exit.py)")
    prompts = (suite_first_turns(cfg.suite, cfg.target.cache_dir, cfg.prompts) if cfg.suite else
               heldout_prompts(cfg.data, target.tokenizer, cfg.prompts, max_positions(target.model)))
    seqs = [greedy_continuations(target, [p], cfg.new_tokens, data_template(cfg.data, target.tokenizer))[0]
            for p in tqdm(prompts, desc="target's greedy continuations", leave=False)]
    report = {"prompts": len(prompts), **({"suite": cfg.suite} if cfg.suite else {}), "new_tokens": cfg.new_tokens,
              "depth": cfg.depth, "heads": {}}
    for name, head in heads.items():
        each = prompt_hits(head, target, seqs, cfg.depth, name)
        training = getattr(head, "record", {}).get("training") or {}
        drafts = (f"block {head.block_size}" if hasattr(head, "block_size") else
                  f"parallel {head.depth}" if method(head.head_type).hits else f"chain {cfg.depth}")
        report["heads"][name] = {"head": cfg.heads[name], "drafts": drafts, **summarize(each, cfg.block),
                                 **({"steps": training["steps"]} if "steps" in training else {}),
                                 **({"train_seconds": seconds} if (seconds := lineage_seconds(training)) is not None
                                    else {})}
        if hasattr(head, "block_size"):  # a block drafter's blocks with only their first b-1 drafts verified
            report["heads"][name]["tau_first"] = first_drafts(each, head.block_size)
    report["seconds"] = round(time.time() - t0, 1)
    print(format_table(report))
    return report


def suite_first_turns(suite: str, cache_dir: Optional[str], n: int) -> list[list[dict[str, str]]]:
    """The first user turn of `n` questions of a standard suite, one category after another in turn (MT-Bench's
    eight alike; HumanEval has one), as chat `messages` lists (serve_bench's engines/suites.suite_prompts asks every
    turn, after the target's own answers)."""
    from itertools import chain, zip_longest

    from selfspec.data.suites import load_suite
    from selfspec.target.model import cache_root

    by_category: dict[str, list] = {}
    for q in load_suite(suite, cache_root(cache_dir)):
        by_category.setdefault(q.category, []).append(q)
    turns = [q for q in chain(*zip_longest(*by_category.values())) if q is not None]
    return [[{"role": "user", "content": q.turns[0]}] for q in turns[:n]]


if __name__ == "__main__":
    main()
