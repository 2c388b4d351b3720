"""The cost model of speculative decoding (docs/cost_model.md), from measured pass costs.

    tokens per cycle = tau (accepted drafts + the bonus token)
    cycle cost       = draft + verify(M)          M = tokens the target verifies (the root + the drafts)
    speedup          = tau * c(1) / (draft + verify(M))
    => the tau a drafter needs for a speedup s:   tau_s = s * (draft + verify(M)) / c(1)

Inputs per engine and precision (engines/*.py measure them; a serve_bench report holds them under "pass_costs"):
c1_ms = one plain decoding step, pass_ms[M] = one target pass over M new tokens after a context (and, where the
engine lets us time it alone, draft_ms = one draft proposal); per drafting method, the draft cost per verification
step is what the engine's run measured (selfspec: `draft_s`, propose + observe) or else is derived from that run: its
mean time per verification step minus verify(M) at its mean M (drafting and everything else a step costs).
"""

from __future__ import annotations

from typing import Any, Optional

SPEEDUPS = (1.0, 1.5, 2.0)


def needed_tau(c1: float, draft: float, verify: float, speedup: float) -> float:
    """The tau at which drafting + verifying gives `speedup` over plain decoding (c1 per token)."""
    return speedup * (draft + verify) / c1


def at(pass_ms: dict[int, float], M: float) -> float:
    """verify(M) from the measured passes, linear between measured M (flat beyond the ends)."""
    xs = sorted(int(k) for k in pass_ms)
    ys = [pass_ms[k] if k in pass_ms else pass_ms[str(k)] for k in xs]
    if M <= xs[0]:
        return ys[0]
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if M <= x1:
            return y0 + (y1 - y0) * (M - x0) / (x1 - x0)
    return ys[-1]


def cost_rows(engines: dict[str, dict[str, Any]], pass_costs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per engine x drafting method: the model's cycle at the method's mean M, the tau needed for each
    speedup in SPEEDUPS, and where the method stands (measured tau over every verification step, its speedup).

    engines: a serve_bench report's "engines" ({engine: {method: summary with steps, step_s, verified_tokens,
    new_tokens, prompts, speedup, num_draft, (draft_s)}}); pass_costs: {engine: {c1_ms, pass_ms}}."""
    out = []
    for engine, rows in engines.items():
        costs = pass_costs.get(engine)
        if not costs or "plain" not in rows:
            continue
        c1, pass_ms = costs["c1_ms"], costs["pass_ms"]
        for name, r in rows.items():
            if name == "plain" or not r.get("steps"):
                continue
            steps = r["steps"]
            M = r["verified_tokens"] / steps  # mean tokens per verification, the root included
            cycle = r["step_s"] * 1e3 / steps  # measured ms per verification step, drafting included
            plain = rows["plain"]
            scale = c1 / (plain["step_s"] * 1e3 / plain["steps"])  # run units -> pass-cost units (run overheads)
            if r.get("draft_s") is not None:  # the engine timed its drafter: propose + observe, per pass
                draft, source = r["draft_s"] * 1e3 / max(steps - r.get("prompts", 0), 1), "measured"
            else:
                draft, source = max(cycle * scale - at(pass_ms, M), 0.0), "derived"
            verify = at(pass_ms, M)
            row = {"engine": engine, "method": name, "num_draft": r.get("num_draft"), "p_min": r.get("p_min"),
                   "c1_ms": c1, "mean_M": round(M, 2), "verify_ms": round(verify, 2), "draft_ms": round(draft, 2),
                   "draft_source": source, "cycle_over_c1": round((draft + verify) / c1, 3),
                   "tau_steps": round(r["new_tokens"] / steps, 3), "tau": r.get("tau"),
                   "measured_speedup": r.get("speedup"),
                   "model_speedup": round((r["new_tokens"] / steps) * c1 / (draft + verify), 3)}
            row.update({f"tau_for_{s:g}x": round(needed_tau(c1, draft, verify, s), 2) for s in SPEEDUPS})
            out.append(row)
    return out


def pass_table(pass_costs: dict[str, dict[str, Any]], Ms: Optional[list[int]] = None) -> str:
    """verify(M) / c(1) per engine: what a verification of M tokens costs in plain steps, i.e. the tau a drafter
    that cost nothing would need to break even; then one draft proposal where the engine timed it alone."""
    Ms = Ms or sorted({int(M) for c in pass_costs.values() for M in c["pass_ms"]})
    lines = ["| engine | c(1) ms | " + " | ".join(f"M={M}" for M in Ms) + " | one draft pass / c(1) |",
             "|---|---|" + "---|" * (len(Ms) + 1)]
    for engine, c in pass_costs.items():
        cells = [f"{at(c['pass_ms'], M) / c['c1_ms']:.2f}" if str(M) in map(str, c["pass_ms"]) else "-" for M in Ms]
        drafts = ", ".join(f"{name} ({d['tokens']} tokens) {d['ms'] / c['c1_ms']:.2f}"
                           for name, d in (c.get("draft_ms") or {}).items()) or "-"
        lines.append(f"| {engine} | {c['c1_ms']:.1f} | " + " | ".join(cells) + f" | {drafts} |")
    return "\n".join(lines)


def cost_table(rows: list[dict[str, Any]]) -> str:
    """One row per engine x method: costs in plain steps, the tau each speedup needs, where the method stands."""
    lines = ["| engine | method | knobs | mean M | verify(M)/c(1) | draft/c(1) | tau for 1.0x | 1.5x | 2x "
             "| measured tau | model speedup | measured speedup |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c1 = r["c1_ms"]
        src = "" if r["draft_source"] == "measured" else " (d)"
        lines.append(f"| {r['engine']} | {r['method']} | n={r['num_draft']} p={r['p_min'] or 0:g} | "
                     f"{r['mean_M']:.2f} | {r['verify_ms'] / c1:.2f} | {r['draft_ms'] / c1:.2f}{src} | "
                     f"{r['tau_for_1x']:.2f} | {r['tau_for_1.5x']:.2f} | {r['tau_for_2x']:.2f} | "
                     f"{r['tau_steps']:.2f} | {r['model_speedup']:.2f}x | {r['measured_speedup']:.2f}x |")
    return "\n".join(lines)


def from_report(path: str) -> str:
    """The cost model's tables from a serve_bench report measured with pass_costs=true."""
    import json
    from pathlib import Path

    report = json.loads(Path(path).read_text())
    if not report.get("pass_costs"):
        from selfspec.core.errors import UserError

        raise UserError(f"'{path}' holds no pass costs: rerun serve_bench with pass_costs=true")
    rows = cost_rows(report["engines"], report["pass_costs"])
    return ("verify(M) / c(1):\n\n" + pass_table(report["pass_costs"]) + "\n\nCost model ((d) = draft cost derived "
            "from the run):\n\n" + cost_table(rows))


if __name__ == "__main__":  # python -m selfspec.engines.costs outputs/reports/llamacpp.json
    import sys

    print(from_report(sys.argv[1]))
