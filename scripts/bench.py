"""Benchmark decoding methods on one target in ONE process, methods interleaved per prompt (so drifting machine
load hits every method alike).

    python scripts/bench.py head=outputs/eagle [target=...] [prompts_file=F.jsonl] [max_new_tokens=128]

Methods (`methods=[...]`): target (our loop, no drafter), target_fp32_head (the same with the full fp32 lm_head
instead of decode.argmax's screened argmax), hf_greedy (HF generate, the speedup baseline),
hf_prompt_lookup (HF prompt_lookup_num_tokens), hf_early_exit (HF assistant_early_exit), and our drafters:
ngram, suffix (a suffix trie of the prompt and output: the `lookup` node), hybrid (head= beside that lookup,
verified in one pass; `<name>_hybrid` for heads.<name>), eagle (chain), eagle_dyn (a chain of dynamic length),
eagle_tree, draft_model, draft_model_dyn, layerskip (self-speculative chain reusing the target's first layers and
their cache), layerskip_tree, dflash (a DFlash head's
whole block of S-1 tokens per pass; the K sweep verifies its first K), dflash_dyn (the block cut by min_confidence).
Greedy decoding; `identical` says whether a method's tokens equal the target's own for every prompt. Prints a table,
writes JSON `{"methods": {name: {tau, tokens_per_s, speedup, identical, ...}}}` and PNG plots (acceptance by draft
position; speedup vs K for the chain drafters). Every option is checked before anything is written; the JSON and
the plots are each written atomically, and only over files this command wrote unless overwrite=true
(selfspec.core.ownership): a failed run leaves the previous ones as they were.
Progress bars go to stderr and vanish when done, so stdout ends with the table.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


from selfspec.core.cli import entry, owned_output
from selfspec.core.errors import UserError
from selfspec.target.model import load_target_from_config, pick_device
from selfspec.decode.drafters import check_options, lookup_options
from selfspec.decode.engine import check_fits, max_positions, stop_token_ids
from selfspec.decode.generate import encode
from selfspec.eval.acceptance import data_template
from selfspec.eval.bench import (REPORT, BenchConfig, bench_prompts, check_writable, confidence_sweep, drafter_for,
                                 head_verdict, inputs, k_sweep, peak_mb, plots, print_table, progress, run_method,
                                 short_config, summarize, tree_sweep, write_plots)
from selfspec.registry import names


def check_config(cfg) -> None:
    """One-line UserError for every option that cannot run, before a model is loaded or a file written."""
    for name, value in (("max_new_tokens", cfg.max_new_tokens), ("max_prompts", cfg.max_prompts),
                        ("num_draft", cfg.num_draft), ("dyn.num_draft", cfg.dyn.num_draft)):
        if value < 1:
            raise UserError(f"{name} must be >= 1 (got {value})")
    if cfg.warmup < 0 or cfg.heldout_prompts < 0:
        raise UserError(f"warmup and heldout_prompts must be >= 0 (got {cfg.warmup} and {cfg.heldout_prompts})")
    if not cfg.methods:
        raise UserError("methods is empty; e.g. methods=[target,hf_greedy,ngram]")
    if any(m.removesuffix("_tree").removesuffix("_dyn") in names() for m in cfg.methods) and cfg.head is None:
        raise UserError(f"methods {', '.join(names())} (and their _tree/_dyn forms) need head=<folder, file or "
                        f"Hub id>")
    if "hybrid" in cfg.methods and cfg.head is None:
        raise UserError("method hybrid needs head=<folder, file or Hub id> (the lookup drafts beside it)")
    for m in cfg.methods:
        if m.endswith("_hybrid") and m.removesuffix("_hybrid") not in cfg.heads:
            raise UserError(f"method {m} needs +heads.{m.removesuffix('_hybrid')}=<head> (the lookup drafts beside it)")
    check_options(chain=False, num_draft=cfg.num_draft, tree_depth=cfg.tree.depth, tree_top_k=cfg.tree.top_k,
                  tree_total_tokens=cfg.tree.total_tokens, min_confidence=cfg.dyn.min_confidence,
                  **lookup_options(cfg.lookup))
    for k in cfg.sweep_k:
        check_options(num_draft=k)
    for c in cfg.sweep_confidence:
        check_options(min_confidence=c)
    for shape in cfg.sweep_tree:
        if len(shape) != 3:
            raise UserError(f"sweep_tree entries are [depth, top_k, total_tokens]; got {list(shape)}")
        check_options(chain=False, tree_depth=shape[0], tree_top_k=shape[1], tree_total_tokens=shape[2])
    pick_device(cfg.device)
    check_writable(cfg.output_file, "output_file")


@entry("bench", BenchConfig)
def main(cfg) -> dict[str, Any]:
    check_config(cfg)
    out_file = Path(cfg.output_file)
    # the report, its config and the plots, each checked before hours of measuring
    with owned_output(cfg, out_file, "output_file", REPORT, inputs(cfg), also=plots(cfg)) as tmp:
        report = measure_all(cfg)
        tmp.write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
    summary = report["methods"]
    print_table(summary)
    for m, shapes in report["sweep_tree"].items():
        print(f"tree sweep ({m}, first prompt): " + "  ".join(f"{k}: tau {v['tau']:.2f} {v['speedup']:.2f}x"
                                                              for k, v in shapes.items()))
    for m, by_c in report["sweep_confidence"].items():
        print(f"min_confidence sweep ({m}, first prompt): " + "  ".join(
            f"{c}: tau {v['tau']:.2f} {v['speedup']:.2f}x" for c, v in by_c.items()))
    write_plots(summary, report["sweep_k"], out_file.parent, cfg.overwrite)
    print(f"wrote {out_file} and plots in {out_file.parent}")
    for line in head_verdict(cfg, summary):  # last: what a `make demo` user reads first
        print(line)
    return report


def measure_all(cfg) -> dict[str, Any]:
    """Every method on every prompt, interleaved per prompt, then the sweeps on the first prompt: the report."""
    methods = list(cfg.methods)
    if cfg.head is not None and "hf_early_exit" in methods:  # compare HF's early exit at the head's own layer
        from selfspec.heads.checkpoint import read_record

        head_cfg = read_record(cfg.head, cfg.head_revision)["head"]
        if head_cfg.get("type") == "layerskip":
            cfg.early_exit_layer = int(head_cfg["exit_layer"])
    device = pick_device(cfg.device)
    target = load_target_from_config(cfg.target, device=device)
    eos = stop_token_ids(target)
    drafters = {m: drafter_for(m, target, cfg) for m in methods if not m.startswith("hf_")}
    if cfg.head is not None and not any(m.removesuffix("_dyn").removesuffix("_tree") in names() for m in methods):
        from selfspec.heads.checkpoint import load_head

        load_head(cfg.head, target, revision=cfg.head_revision)  # no method drafts with it: still this target's
    limit = max_positions(target.model)
    template = data_template(cfg.data, target.tokenizer)  # the template training rendered the data with
    prompts = [encode(target.tokenizer, item, True, template) for item in bench_prompts(cfg, target.tokenizer, limit)]
    for i, ids in enumerate(prompts):  # every prompt, before hours of measuring
        check_fits(target.model, len(ids), cfg.max_new_tokens, f"prompt {i + 1}")
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    with progress(total=(cfg.warmup + len(prompts)) * len(methods), desc="bench") as bar:  # closed on errors too
        for _ in range(cfg.warmup):
            for m in methods:
                bar.set_postfix_str(f"warm-up {m}")
                run_method(m, target, drafters.get(m), prompts[0], short_config(cfg), eos)
                bar.update()
        for i, ids in enumerate(prompts):
            for m in methods:  # interleaved: every method sees the same machine state per prompt
                bar.set_postfix_str(f"prompt {i + 1}/{len(prompts)} {m}")
                runs[m].append({**run_method(m, target, drafters.get(m), ids, cfg, eos), "peak_mb": peak_mb(device)})
                bar.update()
            with bar.external_write_mode():  # the bar steps aside: this line goes to stdout as before
                print(f"prompt {i + 1}/{len(prompts)} done", flush=True)
    return {"target": target.identity, "max_new_tokens": cfg.max_new_tokens, "prompts": len(prompts),
            "device": str(device), "methods": summarize(runs),
            "sweep_k": k_sweep(target, cfg, prompts[0], eos) if cfg.sweep_k else {},
            "sweep_tree": tree_sweep(target, cfg, prompts[0], eos) if cfg.sweep_tree else {},
            "sweep_confidence": confidence_sweep(target, cfg, prompts[0], eos) if cfg.sweep_confidence else {}}


if __name__ == "__main__":
    main()
