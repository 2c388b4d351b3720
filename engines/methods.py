"""What one benchmark row runs, whatever the engine: plain decoding, a head (EAGLE-3 chain or DFlash block), or the
engine's n-gram drafter, with its two knobs; and the screening of those knobs (a small grid, the best kept).

The knobs mean slightly different things per engine (engines/llamacpp.py, engines/selfspec_engine.py,
engines/vllm_engine.py say how each is passed):
    num_draft  tokens drafted per pass. DFlash: llama.cpp and vLLM decode a SHORTER block (anchor + num_draft masks,
               every position still sees the whole block); selfspec decodes the trained block and verifies its first
               num_draft positions.
    p_min      a draft stops at a token the draft finds unlikely. llama.cpp --spec-draft-p-min: the token's
               probability (over the draft's top 10); selfspec min_confidence: the running product of the chain's
               probabilities; vLLM has no such knob for these methods (0 only).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Optional


@dataclass(frozen=True)
class Method:
    name: str  # the table's method column: "plain", "<head type> head", "ngram", "<head type> head + lookup"
    kind: str  # none, a head type, ngram, suffix, hybrid (llama.cpp: --spec-type draft-<kind>; vLLM: its method)
    num_draft: int = 0  # draft tokens per pass (0 for plain)
    p_min: float = 0.0  # the engine's draft-confidence cut (0 = always the full chain / block)
    head: Optional[str] = None  # the head as this engine takes it: checkpoint, GGUF file, export folder
    base: str = ""  # kind hybrid: the type of the head drafting beside the lookup
    lookup: str = ""  # kind hybrid: the lookup (selfspec: suffix or ngram; llama.cpp: its n-gram --spec-type)
    env: tuple[tuple[str, str], ...] = ()  # the engine's environment beside ours (llama.cpp: LLAMA_SPEC_GATE=0)
    ngram_lengths: tuple[int, ...] = ()  # llama.cpp's n-gram kinds: (match, most drafted); () = the bench's own

    @property
    def knobs(self) -> str:
        if self.kind == "none":
            return "-"
        return f"n={self.num_draft} p={self.p_min:g}" + (f" {self.lookup}" if self.lookup else "") + lengths_knob(
            self.ngram_lengths) + "".join(f" {k}={v}" for k, v in self.env)

    def with_head(self, head: Optional[str]) -> "Method":
        return replace(self, head=head)


def grid(method: Method, num_drafts: list[int], p_mins: list[float]) -> list[Method]:
    """The method at every (num_draft, p_min) pair; empty lists keep the method's own value."""
    return [replace(method, num_draft=n, p_min=p) for n in (num_drafts or [method.num_draft])
            for p in (p_mins or [method.p_min])]


def lengths_knob(lengths) -> str:
    """The knobs' " match/drafted" of a row's own n-gram lengths (Method.ngram_lengths, a report row's list), "" where
    it has none."""
    return " {}/{}".format(*lengths) if lengths else ""


def tokens_per_s(row: dict[str, Any]) -> float:
    return sum(len(t) for t in row["tokens"]) / max(sum(row["seconds"]), 1e-9)


def rotated(names: list[str], rep: int, j: int, n_prompts: int) -> list[str]:
    """The order in which the methods (`names`) take prompt j of pass `rep` over `n_prompts` prompts: rotated by one
    per prompt, the rotation going on from one pass to the next, so that a drifting machine hits every row alike
    (selfspec's rows and llama.cpp's servers)."""
    turn = (rep * n_prompts + j) % max(len(names), 1)
    return names[turn:] + names[:turn]


def record_prompt(run: dict[str, Any], j: int, first: bool, tokens: list[int], seconds: float, share: float,
                  counters: dict[str, Any]) -> dict[str, Any]:
    """One decode (or served request) of prompt j into its method's run, the part both engines' rows share: the first
    decode's tokens kept (with `counters`, the prompt's zeroed counters), a later one's compared with them
    (`repeats_differ`), its seconds added as a `share` (1 / repeats) of the prompt's mean. Returns the prompt's
    counters, for the caller to add its share of its own to."""
    if first:
        run["tokens"].append(tokens)
        run["seconds"].append(0.0)
        run["per_prompt"].append(counters)
    else:
        run["repeats_differ"] += tokens != run["tokens"][j]
    run["seconds"][j] += seconds * share
    return run["per_prompt"][j]


def screen(candidates: list[Method], run: Callable[[Method], dict[str, Any]],
           margin: float = 0.0) -> tuple[Method, list[dict[str, Any]]]:
    """Run every candidate (`run(method)` -> a row with tokens, seconds, tau) and keep the fastest, but the first
    unless another is faster than it by more than `margin` (a fraction: a screen on a few prompts measures noise as
    well as speed). Returns it and the grid's rows (knobs, tok/s, tau) in the order run."""
    rows = []
    for m in candidates:
        r = run(m)
        rows.append({"num_draft": m.num_draft, "p_min": m.p_min, "tokens_per_s": round(tokens_per_s(r), 2),
                     "tau": None if r.get("tau") is None else round(r["tau"], 3),
                     **({"lookup": m.lookup} if m.lookup else {}),
                     **({"ngram_lengths": list(m.ngram_lengths)} if m.ngram_lengths else {})})
        print(f"[serve-bench] screen {m.name} {m.knobs}: {rows[-1]['tokens_per_s']:.2f} tok/s, tau {rows[-1]['tau']}",
              flush=True)
    best = max(range(len(rows)), key=lambda i: rows[i]["tokens_per_s"])
    if rows[best]["tokens_per_s"] <= rows[0]["tokens_per_s"] * (1 + margin):
        best = 0
    rows[best]["best"] = True
    return candidates[best], rows


def grid_table(grids: dict[str, dict[str, list[dict[str, Any]]]]) -> str:
    """{engine: {method: screening rows}} -> a markdown table, the kept setting marked."""
    lines = ["| engine | method | num_draft | p_min | tok/s | tau | kept |", "|---|---|---|---|---|---|---|"]
    for engine, methods in grids.items():
        for name, rows in methods.items():
            for r in rows:
                tau = "-" if r["tau"] is None else f"{r['tau']:.2f}"
                what = f"{name} ({r['lookup']})" if r.get("lookup") else name
                what += f" ({lengths_knob(r['ngram_lengths']).strip()})" if r.get("ngram_lengths") else ""
                lines.append(f"| {engine} | {what} | {r['num_draft']} | {r['p_min']:g} | {r['tokens_per_s']:.1f} | "
                             f"{tau} | {'*' if r.get('best') else ''} |")
    return "\n".join(lines)
