"""serve_bench over a standard suite (data/suites.py: MT-Bench, HumanEval): the prompts, one per question turn, and
the figures per category that papers publish (tau, tok/s, speedup over the same engine's plain row, prompts
identical to plain, acceptance per draft position), as a table and a bar plot.

MT-Bench's second turn is asked as MT-Bench defines it, after the model's own first answer: the target's greedy
answer to the first turn (selfspec, fp32, max_new_tokens, computed once before any engine runs). Every engine gets
the same prompt ids, so a lossless method's answers equal its engine's plain answers turn by turn.
"""

from __future__ import annotations

from typing import Any, Optional

from selfspec.engines.methods import tokens_per_s


def suite_prompts(cfg, target,
                  answers: Optional[list[list[int]]] = None) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """Token ids of every question turn of cfg.suite (the first cfg.suite_questions[suite] questions of each
    category), and a label per prompt {suite, category, id, turn}. A later turn follows the target's greedy answer to
    the one before: decoded here, or `answers[i]` for prompt i (a report's plain outputs; `target` then needs only
    its tokenizer)."""
    from tqdm.auto import tqdm

    from selfspec.target.model import cache_root, chat_prompt_ids
    from selfspec.data.suites import load_suite, suite_names
    from selfspec.decode.engine import generate, stop_token_ids

    tok, eos = target.tokenizer, stop_token_ids(target)
    prompts, labels = [], []
    for name in suite_names(cfg.suite):
        questions = load_suite(name, cache_root(cfg.target.cache_dir), int(cfg.suite_questions.get(name, 0)))
        for q in tqdm(questions, desc=f"{name}: the target's answers to earlier turns", leave=False):
            messages: list[dict[str, str]] = []
            for t, text in enumerate(q.turns):
                messages.append({"role": "user", "content": text})
                ids = chat_prompt_ids(tok, messages)
                prompts.append(ids)
                labels.append({"suite": name, "category": q.category, "id": q.id, "turn": t + 1})
                if t + 1 < len(q.turns):  # the model's own answer, as the next turn's context
                    answer = (answers[len(prompts) - 1] if answers is not None else
                              generate(target, None, ids, cfg.max_new_tokens, eos_token_ids=eos).tokens)
                    messages.append({"role": "assistant", "content": tok.decode(
                        [i for i in answer if i not in eos], skip_special_tokens=True)})
    return prompts, labels


def category_of(label: dict[str, Any]) -> str:
    return label["category"] if label["suite"] == "mt_bench" else label["suite"]


def by_category(results: dict[str, dict[str, dict[str, Any]]], labels: list[dict[str, Any]]) -> dict:
    """{engine: {method: {category: figures}}} over the prompts of each category, plus "all". tau = 1 + accepted /
    drafts from the row's per-prompt spec counters (each engine's own: engines/*_engine.py, llamacpp.py): llama.cpp and
    vLLM count only the passes that carried a draft, so their tau is per drafted pass. tokens_per_pass = generated
    tokens / target passes (generated - accepted), the same count in every engine: the figure to compare engines by
    (the two agree when every pass drafts; an n-gram drafter or a p_min cut often drafts nothing)."""
    cats = {c: [i for i, lab in enumerate(labels) if category_of(lab) == c]
            for c in dict.fromkeys(category_of(lab) for lab in labels)}
    cats["all"] = list(range(len(labels)))
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for engine, rows in results.items():
        plain = rows.get("plain")
        for name, r in rows.items():
            if len(r["tokens"]) != len(labels):  # a row that lost prompts (an engine abort): no per-category figures
                continue
            out.setdefault(engine, {})[name] = {c: _figures(r, plain, idx) for c, idx in cats.items()}
    return out


def _figures(row: dict[str, Any], plain: Optional[dict[str, Any]], idx: list[int]) -> dict[str, Any]:
    pick = lambda r: {"tokens": [r["tokens"][i] for i in idx], "seconds": [r["seconds"][i] for i in idx]}  # noqa: E731
    spec = [row["per_prompt"][i] for i in idx] if row.get("per_prompt") else []
    drafts = sum(p["drafts"] for p in spec)
    tau = 1 + sum(p["accepted"] for p in spec) / drafts if drafts else (1.0 if row.get("tau") == 1.0 else None)
    n, accepted = sum(len(row["tokens"][i]) for i in idx), sum(p["accepted"] for p in spec)
    per_pass = n / (n - accepted) if spec and n > accepted else (1.0 if row.get("tau") == 1.0 else None)
    f: dict[str, Any] = {"prompts": len(idx), "tokens_per_s": round(tokens_per_s(pick(row)), 2),
                         "tau": None if tau is None else round(tau, 3),
                         "tokens_per_pass": None if per_pass is None else round(per_pass, 3)}
    if plain is not None:
        f["speedup"] = round(tokens_per_s(pick(row)) / tokens_per_s(pick(plain)), 3)
        f["identical"] = sum(row["tokens"][i] == plain["tokens"][i] for i in idx)
        # the standard error of the per-prompt speedups (each prompt's tok/s over plain's on it)
        each = [(len(row["tokens"][i]) / max(row["seconds"][i], 1e-9)) /
                max(len(plain["tokens"][i]) / max(plain["seconds"][i], 1e-9), 1e-9) for i in idx]
        mean = sum(each) / len(each)
        f["speedup_sem"] = round((sum((x - mean) ** 2 for x in each) / (len(each) - 1) / len(each)) ** 0.5, 3) \
            if len(each) > 1 else None
    per_pos = [p["accepted_by_position"] for p in spec if p.get("accepted_by_position")]
    if per_pos and drafts:  # share of drafted passes that accepted >= d tokens
        n = max(len(a) for a in per_pos)
        f["accept_by_position"] = [round(sum(a[d] for a in per_pos if d < len(a)) / drafts, 3) for d in range(n)]
    return f


def category_table(cats: dict, sampled: Optional[dict] = None, temperature: Optional[float] = None) -> str:
    """Markdown: one row per engine and method, one column per category: 'tokens per target pass / speedup' (and
    the sampled rows' tokens per pass): the figure every engine counts alike (by_category)."""
    names = list(next(iter(next(iter(cats.values())).values()))) if cats else []
    lines = ["| engine | method | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for engine, methods in cats.items():
        for name, per in methods.items():
            cells = []
            for c in names:
                f = per[c]
                tau = "-" if f.get("tokens_per_pass") is None else f"{f['tokens_per_pass']:.2f}"
                cell = f"{tau} / {f['speedup']:.2f}x" if "speedup" in f else tau
                if f.get("identical") is not None and f["identical"] < f["prompts"]:
                    cell += f" ({f['identical']}/{f['prompts']} identical)"
                cells.append(cell)
            lines.append(f"| {engine} | {name} | " + " | ".join(cells) + " |")
    for name, per in (sampled or {}).items():
        cells = ["-" if per[c].get("tokens_per_pass") is None else f"{per[c]['tokens_per_pass']:.2f}" for c in names]
        lines.append(f"| selfspec fp32, temperature {temperature:g} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def hybrid_table(cats: dict) -> str:
    """Markdown: per engine and hybrid row ("<head> + lookup"), per category, its speedup +- its standard error against
    the better of its head alone and the engine's lookups alone (ngram, suffix), and whether it holds its own: at
    least that, within one standard error ("yes"), or not ("no")."""
    lines = []
    for engine, methods in cats.items():
        for name, per in methods.items():
            if not name.endswith(" + lookup") or "speedup" not in per["all"]:
                continue
            rivals = [m for m in (name.removesuffix(" + lookup"), "ngram", "suffix") if m in methods]
            if not lines:
                lines = ["| engine | hybrid | " + " | ".join(per) + " |", "|---|---|" + "---|" * len(per)]
            cells = []
            for c, f in per.items():
                best = max(rivals, key=lambda m: methods[m][c].get("speedup", 0.0))
                b, sem = methods[best][c]["speedup"], f.get("speedup_sem") or 0.0
                ok = "yes" if round(f["speedup"] + sem, 3) >= round(b, 3) else "no"
                cells.append(f"{f['speedup']:.2f}x +-{sem:.2f} vs {b:.2f}x ({best}): {ok}")
            lines.append(f"| {engine} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def position_table(cats: dict) -> str:
    """Markdown: per engine and drafting method, the share of drafted passes (all prompts) accepting >= d tokens,
    for the engines that count it per position (selfspec, vLLM)."""
    rows = [(e, m, per["all"]["accept_by_position"]) for e, methods in cats.items() for m, per in methods.items()
            if per["all"].get("accept_by_position")]
    if not rows:
        return ""
    n = max(len(a) for _, _, a in rows)
    lines = ["| engine | method | " + " | ".join(f"d={d + 1}" for d in range(n)) + " |", "|---|---|" + "---|" * n]
    for e, m, a in rows:
        lines.append(f"| {e} | {m} | " + " | ".join(f"{x:.2f}" for x in a) + " |" + " - |" * (n - len(a)))
    return "\n".join(lines)


def category_plot(cats: dict, path, title: str, overwrite: bool = False) -> None:
    """Bar plot: per engine (one panel each), tokens per target pass of every drafting method per category."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from selfspec.core.ownership import save_png

    engines = list(cats)
    fig, axes = plt.subplots(len(engines), 1, figsize=(10, 2.6 * len(engines) + 0.6), squeeze=False)
    for ax, engine in zip(axes[:, 0], engines):
        methods = {m: per for m, per in cats[engine].items() if m != "plain"}
        names = list(next(iter(cats[engine].values())))
        width = 0.8 / max(len(methods), 1)
        for j, (m, per) in enumerate(methods.items()):
            ax.bar([i + j * width for i in range(len(names))], [per[c].get("tokens_per_pass") or 0 for c in names],
                   width, label=f"{m} ({per['all'].get('speedup', 0):.2f}x overall)")
        ax.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(names))], names, fontsize=8)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(ylabel="tokens per target pass", title=engine)
        if methods:
            ax.legend(fontsize=7, loc="upper right")
    fig.suptitle(title)
    fig.tight_layout()
    save_png(fig, path, overwrite)
    plt.close(fig)


SUMMARY_KEYS = ("date", "machine", "load_average", "seconds", "target", "heads", "suite", "suite_questions",
                "prompts", "max_new_tokens", "engines", "fp32_mismatches", "lookup_cost", "hybrid_table")


def summary(report: dict[str, Any]) -> dict[str, Any]:
    """A suite report without its token ids and per-prompt counters (docs/reports/suites.json: what the README's
    table is rendered from, small enough to keep in git)."""
    out = {k: report[k] for k in SUMMARY_KEYS if k in report}
    out["all"] = {e: {m: per["all"] for m, per in methods.items()} for e, methods in report["categories"].items()}
    return out


def front_table(summary: dict[str, Any]) -> str:
    """The README's table: per engine and method, its speedup over the engine's plain decoding on the whole suite,
    tokens per target pass and prompts identical to plain; the header says when, where and on what."""
    n, command = summary["prompts"], summary.get("command", "make check-suites")
    if summary.get("commit"):
        command += f"` at `{summary['commit']}"
    lines = [f"Measured {summary['date']} on {summary['machine']} (`{command}`: {n} prompts of MT-Bench and "
             f"HumanEval, greedy, one request at a time; [docs/reports/suites.json](docs/reports/suites.json)):", "",
             "| engine | drafter | speedup | tokens per target pass | identical to plain |", "|---|---|---|---|---|"]
    for engine, methods in summary["all"].items():
        for name, f in methods.items():
            if name == "plain" or "speedup" not in f:
                continue
            per_pass = "-" if f.get("tokens_per_pass") is None else f"{f['tokens_per_pass']:.2f}"
            same = f"{f['identical']}/{f['prompts']}"
            lines.append(f"| {engine} | `{name}` | {f['speedup']:.2f}x | {per_pass} | {same} |")
    heads = "; ".join(f"`{name}` is `{path}`" for name, path in summary.get("heads", {}).items())
    return "\n".join(lines + ([f"\nThe heads: {heads}."] if heads else []))
