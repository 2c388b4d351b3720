"""The serving benchmark's table: per engine and precision, one row per method (tok/s, tau, speedup over the same
engine's plain row, prompts identical to plain), and why an output differs (the fp32 target's logits there)."""

from __future__ import annotations

from typing import Any

from selfspec.engines.methods import lengths_knob, tokens_per_s

FULL_PRECISION = ("selfspec fp32", "llama.cpp F32", "vLLM float32")  # engines whose outputs must equal plain's


def divergence(target, prompt: list[int], plain: list[int], other: list[int]) -> dict[str, Any]:
    """Why two greedy outputs of one prompt differ: the first differing position, both tokens, and the fp32
    target's logits there (the gap between them and each one's rank). A near-tie (both in the top 2, a gap of
    hundredths) is what a reduced precision flips; a wide gap in fp32 would be a bug."""
    import torch

    k = next((j for j, (x, y) in enumerate(zip(plain, other)) if x != y), min(len(plain), len(other)))
    if k == min(len(plain), len(other)):  # one output stops where the other goes on
        return {"position": k, "note": "one output is a prefix of the other (a stop token in one of them)"}
    with torch.no_grad():
        ids = torch.tensor([prompt + plain[:k]], device=target.model.device)
        logits = target.model(ids).logits[0, -1].float()
    rank = lambda t: int((logits > logits[t]).sum())  # noqa: E731 (0 = the fp32 argmax)
    return {"position": k, "plain_token": plain[k], "token": other[k], "fp32_rank_plain": rank(plain[k]),
            "fp32_rank_token": rank(other[k]), "fp32_gap": round(float(logits[plain[k]] - logits[other[k]]), 4)}


KEPT = ("counters", "server_decode_tok_s", "start_s", "num_draft", "p_min", "steps", "step_s", "verified_tokens",
        "draft_s", "lookup", "ngram_lengths", "head_siblings", "repeats", "repeats_differ")


def summarize(results: dict[str, dict[str, dict[str, Any]]], prompts: list[list[int]], target) -> tuple[dict, str]:
    """{engine: {method: row}} -> ({engine: {method: summary}}, markdown table). Each row's tokens are compared with
    the same engine's plain row; each differing prompt gets its divergence."""
    summary: dict[str, dict[str, Any]] = {}
    lines = ["| engine | method | knobs | tok/s | tau | speedup | identical to plain |",
             "|---|---|---|---|---|---|---|"]
    for engine, rows in results.items():
        plain = rows["plain"]
        for name, r in rows.items():
            same = sum(a == b for a, b in zip(r["tokens"], plain["tokens"]))
            differing = [i for i, (a, b) in enumerate(zip(r["tokens"], plain["tokens"])) if a != b]
            s = {"tokens_per_s": round(tokens_per_s(r), 2), "tau": None if r["tau"] is None else round(r["tau"], 3),
                 "speedup": round(tokens_per_s(r) / tokens_per_s(plain), 3), "identical_prompts": same,
                 "prompts": len(prompts), "differing_prompts": differing,
                 "divergences": [divergence(target, prompts[i], plain["tokens"][i], r["tokens"][i]) | {"prompt": i}
                                 for i in differing],
                 "new_tokens": sum(len(t) for t in r["tokens"]), **{k: r[k] for k in KEPT if k in r}}
            summary.setdefault(engine, {})[name] = s
            tau = "-" if s["tau"] is None else f"{s['tau']:.2f}"
            knobs = "-" if name == "plain" else (f"n={r.get('num_draft', '?')} p={r.get('p_min', 0):g}"
                                                 + (f" {r['lookup']}" if r.get("lookup") else "")
                                                 + lengths_knob(r.get("ngram_lengths"))
                                                 + (" leaves {}x{}".format(*r["head_siblings"])
                                                    if r.get("head_siblings") else ""))
            lines.append(f"| {engine} | {name} | {knobs} | {s['tokens_per_s']:.1f} | {tau} | {s['speedup']:.2f}x | "
                         f"{same}/{len(prompts)} |")
    return summary, "\n".join(lines)


def divergence_lines(summary: dict[str, dict[str, Any]]) -> list[str]:
    out = []
    for engine, rows in summary.items():
        for name, row in rows.items():
            for d in row["divergences"]:
                why = d.get("note") or (f"fp32 ranks {d['fp32_rank_plain']} (plain) and {d['fp32_rank_token']}, "
                                        f"logit gap {d['fp32_gap']:+.4f}")
                out.append(f"[serve-bench] {engine} {name}: prompt {d['prompt']} differs from plain at token "
                           f"{d['position']}: {why}")
    return out


def full_precision_mismatches(summary: dict[str, dict[str, Any]]) -> list[str]:
    """'engine method' of every fp32/F32 row whose tokens differ from that engine's plain tokens (a bug until a
    divergence shows a near-tie)."""
    return [f"{engine} {name}" for engine, rows in summary.items() if engine in FULL_PRECISION
            for name, row in rows.items() if row["differing_prompts"]]
