"""Lookup drafters replayed over a serve_bench report's greedy outputs: their exact tau in seconds, no target run.

    python scripts/replay_lookup.py report=outputs/reports/suites.json \\
        "+variants.corpus={corpus: data/regenerated/smollm2-135m_sharegpt_t1.jsonl}" "+variants.deep={alpha: 2.0}"

A lookup's draft depends on the committed text alone and a greedy pass accepts it as far as it follows the target's
own continuation, so replaying it over each prompt and the engine's plain output gives the tokens a target pass
that engine would measure (decode/replay.py): generated / (generated - accepted), as the suite tables count them in
every engine. Each variant is a `lookup` node (LookupConfig: kind, num_draft, depth, min_prob, alpha, tree, corpus)
over the report's own lookup settings; the default variants are the report's selfspec `ngram` and `suffix` rows, so
their replayed figure is checked against the measured one (another engine's rows are its own drafters, not these).
Time is a model: a pass costs one plain step, `round_cost` more when it carries a draft and `row_cost` per drafted
token; both are fitted (least squares) to the measured speedups of the variants that replay a row of the report
exactly, or given. Prints a table (tokens a pass overall and per category, drafted tokens a pass, the modelled
speedup), then one JSON object on the last line.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

from selfspec.core.cli import entry
from selfspec.core.errors import UserError


@dataclass
class ReplayLookupConfig:
    """Schema of conf/replay_lookup.yaml."""

    report: str = field(default="outputs/reports/suites.json", metadata={"help": (
        "A serve_bench report with its token ids (output_file of make check-suites or serve_bench suite=...).")})
    engine: str = field(default="selfspec fp32", metadata={"help": (
        "Whose plain outputs are replayed (a key of the report's `tokens`): the target's greedy continuation.")})
    variants: dict[str, Any] = field(default_factory=lambda: {"ngram": {"kind": "ngram", "num_draft": 5},
                                                              "suffix": {}}, metadata={"help": (
        "name -> lookup settings (LookupConfig keys) over the report's own; a name of one of the engine's rows is "
        "checked against its measured tokens a pass. Add one with +variants.NAME={key: value}.")})
    round_cost: Optional[float] = field(default=None, metadata={"help": (
        "Plain steps a pass carrying a draft costs beyond a plain step (null: fitted to the report's rows).")})
    row_cost: Optional[float] = field(default=None, metadata={"help": (
        "Plain steps each drafted token adds to its pass (null: fitted to the report's rows).")})


@entry("replay_lookup", ReplayLookupConfig)
def main(cfg) -> dict:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from selfspec.decode.drafters import LookupConfig, lookup_drafter
    from selfspec.decode.replay import Replayed, replay

    report = read_report(cfg.report, cfg.engine)
    variants = {}
    for name, over in cfg.variants.items():  # every variant checked before anything is replayed
        try:
            v = OmegaConf.merge(OmegaConf.structured(LookupConfig), report.get("lookup") or {}, over or {})
        except OmegaConfBaseException as e:  # an unknown key or a value of the wrong type: OmegaConf's first line
            raise UserError(f"variants.{name}: {str(e).splitlines()[0]}") from e
        variants[name] = v
    tokenizer = _tokenizer(report)
    drafters = {name: lookup_drafter(SimpleNamespace(tokenizer=tokenizer), v) for name, v in variants.items()}
    prompts, outputs = prompts_of(report, cfg.engine, tokenizer), report["tokens"][cfg.engine]["plain"]
    categories = [lab.get("category", "all") for lab in report.get("labels") or [{}] * len(prompts)]
    t0 = time.time()
    counts: dict[str, dict[str, Replayed]] = {}
    for name, d in drafters.items():
        per = counts[name] = {}
        for i, (cat, prompt, out) in enumerate(zip(categories, prompts, outputs)):
            try:
                r = replay(d, prompt, out, report["max_new_tokens"])
            except ValueError as e:  # an output its own report's max_new_tokens could not have produced
                raise UserError(f"report '{cfg.report}', {cfg.engine} prompt {i}: {e}") from e
            per[cat], per["all"] = per.get(cat, Replayed()) + r, per.get("all", Replayed()) + r
    rows = {n: per["all"] for n, per in report["categories"].get(cfg.engine, {}).items()}
    exact = [n for n in counts if n in rows and rows[n].get("tokens_per_pass") is not None
             and abs(rows[n]["tokens_per_pass"] - counts[n]["all"].tokens_per_pass) < 6e-4]
    costs = (cfg.round_cost, cfg.row_cost)
    if None in costs:
        costs = fit_costs([(counts[n]["all"], rows[n]["speedup"]) for n in exact])
    result = {"report": cfg.report, "engine": cfg.engine, "seconds": round(time.time() - t0, 2),
              "costs": None if costs is None else {"round": costs[0], "row": costs[1]}, "exact": exact,
              "variants": {}}
    for name, per in counts.items():
        a = per["all"]
        result["variants"][name] = {
            "lookup": OmegaConf.to_container(variants[name]), "tokens_per_pass": round(a.tokens_per_pass, 4),
            "tau": round(a.tau, 4),
            "by_category": {c: round(r.tokens_per_pass, 4) for c, r in per.items() if c != "all"},
            "drafted_per_pass": round(a.drafted / a.passes, 3) if a.passes else 0.0,
            "measured": rows[name].get("tokens_per_pass") if name in rows else None,
            "modelled_speedup": None if costs is None else round(modelled_speedup(a, costs), 3)}
    print(table(result))
    print(json.dumps(result), flush=True)
    return result


def read_report(path: str, engine: str) -> dict:
    """A serve_bench report with the token ids of `engine`'s plain row, or one line saying what is wrong."""
    try:
        report = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read report '{path}': {e}") from e
    if not isinstance(report, dict) or not isinstance(report.get("tokens"), dict) or "categories" not in report:
        raise UserError(f"'{path}' is not a serve_bench report with token ids and figures per category "
                        "(docs/reports/ keeps summaries without them: replay the output_file of the run)")
    if engine not in report["tokens"] or "plain" not in report["tokens"][engine]:
        raise UserError(f"report '{path}' has no plain row for engine '{engine}'; it has: "
                        f"{', '.join(report['tokens'])}")
    if "prompt_tokens" not in report and not report.get("suite"):
        raise UserError(f"report '{path}' keeps no prompt ids (written before they were kept) and is no suite's: "
                        "its prompts cannot be rebuilt")
    return report


def _tokenizer(report: dict):
    from selfspec.target.model import TargetConfig, load_tokenizer

    return load_tokenizer(TargetConfig(name_or_path=report["target"]))


def prompts_of(report: dict, engine: str, tokenizer) -> list[list[int]]:
    """The report's prompt ids: kept in it, or (a suite report written before they were) rebuilt from the suite's
    questions with the report's selfspec plain answers as the earlier turns' (what serve_bench decoded for them)."""
    if "prompt_tokens" in report:
        prompts = report["prompt_tokens"]
    else:
        from omegaconf import OmegaConf

        from selfspec.engines.suites import suite_prompts

        cfg = OmegaConf.create({"suite": report["suite"], "suite_questions": report["suite_questions"],
                                "max_new_tokens": report["max_new_tokens"], "target": {"cache_dir": None}})
        answers = report["tokens"].get("selfspec fp32", report["tokens"][engine])["plain"]
        prompts, labels = suite_prompts(cfg, SimpleNamespace(tokenizer=tokenizer), answers)
        if labels != report["labels"]:
            raise UserError(f"the suite's prompts rebuilt here differ from the report's ({len(labels)} against "
                            f"{len(report['labels'])}): its suite files changed since")
    if len(prompts) != len(report["tokens"][engine]["plain"]):
        raise UserError(f"the report has {len(prompts)} prompts but {len(report['tokens'][engine]['plain'])} "
                        f"outputs of {engine}")
    return prompts


def fit_costs(points: list) -> Optional[tuple[float, float]]:
    """(round_cost, row_cost) fitted to [(replayed counts, measured speedup)]: generated / speedup plain steps =
    prefills + passes + round_cost * drafted passes + row_cost * drafted tokens. None under two points."""
    if len(points) < 2:
        return None
    import numpy as np

    A = np.array([[r.drafted_passes, r.drafted] for r, _ in points], dtype=float)
    y = np.array([r.generated / s - r.sequences - r.passes for r, s in points], dtype=float)
    (a, b), *_ = np.linalg.lstsq(A, y, rcond=None)
    return round(float(a), 4), round(float(b), 4)


def modelled_speedup(r, costs: tuple[float, float]) -> float:
    """Plain decoding's steps (one a generated token) over the replayed ones under the cost model."""
    return r.generated / (r.sequences + r.passes + costs[0] * r.drafted_passes + costs[1] * r.drafted)


def table(result: dict) -> str:
    cats = list(next(iter(result["variants"].values()))["by_category"]) if result["variants"] else []
    head = ["variant", "tokens a pass", "measured", "drafted a pass", "modelled speedup", *cats]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, v in result["variants"].items():
        measured, modelled = v["measured"], v["modelled_speedup"]
        cells = [name, f"{v['tokens_per_pass']:.3f}", "-" if measured is None else f"{measured:.3f}",
                 f"{v['drafted_per_pass']:.2f}", "-" if modelled is None else f"{modelled:.3f}x",
                 *(f"{v['by_category'][c]:.3f}" for c in cats)]
        lines.append("| " + " | ".join(cells) + " |")
    c = result["costs"]
    cost = ("no cost model (fewer than two variants replay a row of the report exactly; pass round_cost= and "
            "row_cost=)" if c is None else f"a drafted pass costs {c['round']:+.3f} plain steps, each drafted token "
            f"{c['row']:+.3f}" + (f" (fitted to {', '.join(result['exact'])})" if result["exact"] else " (given)"))
    return (f"[replay] {result['engine']}'s plain outputs of {result['report']}, replayed in {result['seconds']} s; "
            f"{cost}\n\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
