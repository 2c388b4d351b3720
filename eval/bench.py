"""The decoding benchmark that scripts/bench.py drives: its config, the methods it compares (HF generate, our loop
alone, our drafters built by name), one timed generation per method and prompt, the summary per method (tau,
tokens/s, speedup, identical), the sweeps over K, tree shape and min_confidence, the table, the plots, and the files
a run writes (core/ownership.py). Reads decode, heads, data and core; only scripts read it."""

from __future__ import annotations

import os
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Optional

import torch
from tqdm.auto import tqdm

from selfspec.core.errors import UserError
from selfspec.core.ownership import PNG, Kind, json_keys, save_png
from selfspec.target.model import TargetConfig
from selfspec.data.config import DataConfig
from selfspec.decode.draft import NUM_DRAFT
from selfspec.decode.drafters import LookupConfig, build_drafter, lookup_options
from selfspec.decode.engine import generate
from selfspec.decode.generate import TreeConfig, read_prompts_file
from selfspec.heads.checkpoint import head_type, trained_seconds
from selfspec.registry import method as registered, names

DEFAULT_PROMPTS = [
    "Explain what a KV cache is in a transformer, in three sentences.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "List five tips for writing clear technical documentation.",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
]


@dataclass
class DynConfig:
    """The `<method>_dyn` rows: a chain of dynamic length (decode/draft.py)."""

    num_draft: int = field(default=8, metadata={"help": (
        "A chain of at most this many tokens, which stops once the product of its drafted tokens' probabilities "
        "falls below min_confidence.")})
    min_confidence: float = field(default=0.15, metadata={"help": "The chain's stopping threshold."})


@dataclass
class BenchConfig:
    """Schema of conf/bench.yaml."""

    # keys an older selfspec named otherwise (issue 51: one name for the draft length): refused naming the new one
    RENAMED: ClassVar[dict[str, str]] = {"dyn_num_draft": "dyn.num_draft", "min_confidence": "dyn.min_confidence"}

    target: TargetConfig = field(default_factory=TargetConfig)
    methods: list[str] = field(
            default_factory=lambda: ["target", "hf_greedy", "hf_prompt_lookup", "ngram"], metadata={"help": (
        "Which methods to run, in this order for every prompt (see scripts/bench.py's docstring).")})
    head: Optional[str] = field(default=None, metadata={"help": (
        "EAGLE head for eagle / eagle_tree (folder, file or Hub id); draft model for draft_model.")})
    head_revision: Optional[str] = field(default=None, metadata={"help": (
        "A Hub head's branch, tag or commit (for head= and every entry of heads); null = main.")})
    heads: dict[str, str] = field(default_factory=dict, metadata={"help": (
        "More trained heads, side by side in the same run: {name: head}; methods `name` (chain), `name_dyn` and "
        f"`name_tree` draft with that head, whatever its type ({', '.join(names())}). Added with Hydra's `+`: "
        "+heads.shipped=heads/pretrained/smollm2-135m-eagle methods=[target,hf_greedy,shipped,shipped_tree]")})
    draft_model: Optional[str] = field(default=None, metadata={"help": (
        "A separate small draft model (HF id or folder) for the `draft_model` method.")})
    prompts_file: Optional[str] = field(default=None, metadata={"help": (
        'JSONL prompts ({"prompt": ...} or {"messages": [...]}); null = held-out prompts of `data` (heldout_prompts '
        '> 0) or a few built-in chat prompts.')})
    heldout_prompts: int = field(default=0, metadata={"help": (
        "Use the first user turns of this many held-out conversations of `data` as prompts (0 = off).")})
    data: DataConfig = field(default_factory=DataConfig)
    max_prompts: int = field(default=4, metadata={"help": "Prompts benchmarked (built-in ones, then held-out ones)."})
    max_new_tokens: int = field(default=128, metadata={"help": "Tokens generated per prompt and method."})
    num_draft: int = field(default=NUM_DRAFT, metadata={"help": (
        "Chain length of ngram / eagle / draft_model and HF prompt lookup.")})
    tree: TreeConfig = field(default_factory=lambda: TreeConfig(depth=4, top_k=4, total_tokens=16), metadata={
        "help": "The `_tree` methods' tree shape."})
    dyn: DynConfig = field(default_factory=DynConfig, metadata={"help": "The `_dyn` methods' chains."})
    lookup: LookupConfig = field(default_factory=LookupConfig, metadata={"help": (
        "The `suffix` method's drafter and the lookup of the `hybrid` methods (`hybrid`: head= beside it; "
        "`<name>_hybrid`: heads.<name> beside it).")})
    sweep_confidence: list[float] = field(default_factory=list, metadata={"help": (
        "dyn.min_confidence values swept for the `_dyn` methods (first prompt only; [] = no sweep).")})
    early_exit_layer: int = field(default=4, metadata={"help": (
        "Layers of the early-exit draft for hf_early_exit; a layerskip head= replaces it with its own exit_layer.")})
    sweep_k: list[int] = field(default_factory=lambda: [1, 2, 3, 5, 8], metadata={"help": (
        "Chain lengths swept for the speedup-vs-K plot (first prompt only; [] = no sweep).")})
    sweep_tree: list[list[int]] = field(default_factory=list, metadata={"help": (
        "Tree shapes [depth, top_k, total_tokens] swept for the tree drafters (first prompt only; [] = no sweep): "
        "tau and speedup over the target alone per shape, to pick the tree that is fastest on this machine.")})
    screened_argmax: bool = field(default=True, metadata={"help": (
        "Greedy verification through decode.argmax.ScreenedArgmax (the same fp32 argmax from a bf16 screen) for "
        "every method of ours except target_fp32_head; false = the full fp32 lm_head everywhere.")})
    warmup: int = field(default=1, metadata={"help": "Untimed warm-up generations before measuring."})
    output_file: str = field(default="outputs/bench/bench.json", metadata={"help": (
        "The JSON report; its .config.yaml and the PNG plots (acceptance_by_position.png, speedup_vs_k.png) go "
        "next to it.")})
    overwrite: bool = field(default=False, metadata={"help": (
        "Replace an existing report, config or plot there that this command did not write (never an input).")})
    device: Optional[str] = field(default=None, metadata={"help": "torch device (default: cuda if present, else cpu)."})


REPORT = Kind("bench report", folder=False, mine=json_keys("methods", "target"))  # core/ownership.py
PLOTS = ("acceptance_by_position.png", "speedup_vs_k.png")


def plots(cfg) -> list[tuple[Path, str, Kind]]:
    """The plots a run writes beside its report (core/cli.owned_output checks them with it)."""
    return [(Path(cfg.output_file).parent / name, "plot", PNG) for name in (PLOTS if cfg.sweep_k else PLOTS[:1])]


def inputs(cfg) -> list[tuple[str, object]]:
    return [("prompts_file", cfg.prompts_file), ("head", cfg.head), ("lookup.corpus", cfg.lookup.corpus)]


def check_writable(path: str, name: str) -> None:
    """Refuse, before any work, an output path that cannot be written, without creating anything."""
    p = Path(path).expanduser().absolute()
    if p.is_dir():
        raise UserError(f"{name} '{path}' is a folder; pass a file path")
    existing = next(q for q in p.parents if q.exists())
    if not existing.is_dir():
        raise UserError(f"cannot create the folder of {name} '{path}': '{existing}' is a file; pick another path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"cannot write {name} '{path}': '{existing}' is not writable; pick a writable location")


def peak_mb(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # process peak RSS (Linux: KiB)


def _hf(target, ids: list[int], max_new: int, eos: list[int], **kw) -> tuple[list[int], float]:
    model = target.model
    x = torch.tensor([ids], device=model.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos[0], **kw)
    return out[0, len(ids):].tolist(), time.perf_counter() - t0


def drafter_for(method: str, target, cfg, k: Optional[int] = None, confidence: Optional[float] = None):
    dyn = method.endswith("_dyn")
    method = method.removesuffix("_dyn")
    swept_k = k
    k = k or (cfg.dyn.num_draft if dyn else cfg.num_draft)
    min_confidence = (cfg.dyn.min_confidence if confidence is None else confidence) if dyn else 0.0
    if method in ("target", "target_fp32_head"):
        return None
    if method == "ngram":
        return build_drafter("ngram", target, num_draft=k)
    if method == "suffix":
        return build_drafter("suffix", target, **lookup_options(cfg.lookup))
    if method == "hybrid" or method.endswith("_hybrid"):  # a head's chain (or block) beside the lookup
        base = method.removesuffix("_hybrid")
        head = cfg.heads[base] if base in cfg.heads else cfg.head
        block = head is not None and registered(head_type(head, cfg.head_revision)).per_pass is not None
        return build_drafter("hybrid", target, head=head, head_revision=cfg.head_revision, chain=True,
                             num_draft=swept_k if block else k, min_confidence=min_confidence,
                             **lookup_options(cfg.lookup))
    if method == "draft_model":
        return build_drafter("draft_model", target, draft_model=cfg.draft_model, num_draft=k,
                             min_confidence=min_confidence)
    base = method.removesuffix("_tree")
    if base in cfg.heads or base in names():  # a trained head: <name> is its chain, <name>_tree its tree
        head, kind = ((cfg.heads[base], head_type(cfg.heads[base], cfg.head_revision)) if base in cfg.heads
                      else (cfg.head, base))
        if registered(kind).per_pass:  # a block drafter (DFlash, DSpark, P-EAGLE): one draft pass, all of it
            # verified, the first K in the K sweep
            return build_drafter(kind, target, head=head, head_revision=cfg.head_revision, chain=method == base,
                                 num_draft=swept_k, min_confidence=min_confidence)
        return build_drafter(kind, target, head=head, head_revision=cfg.head_revision, chain=method == base,
                             num_draft=k, tree_depth=cfg.tree.depth, tree_top_k=cfg.tree.top_k,
                             tree_total_tokens=cfg.tree.total_tokens, min_confidence=min_confidence)
    raise UserError(f"unknown bench method '{method}'")


def run_method(method: str, target, drafter, ids: list[int], cfg, eos: list[int]) -> dict[str, Any]:
    if method == "hf_greedy":
        tokens, secs = _hf(target, ids, cfg.max_new_tokens, eos)
        return {"tokens": tokens, "seconds": secs, "tau": 1.0}
    if method == "hf_prompt_lookup":
        tokens, secs = _hf(target, ids, cfg.max_new_tokens, eos, prompt_lookup_num_tokens=cfg.num_draft)
        return {"tokens": tokens, "seconds": secs, "tau": None}
    if method == "hf_early_exit":
        tokens, secs = _hf(target, ids, cfg.max_new_tokens, eos, assistant_early_exit=cfg.early_exit_layer)
        return {"tokens": tokens, "seconds": secs, "tau": None}
    r = generate(target, drafter, ids, cfg.max_new_tokens, eos_token_ids=eos,
                 screened_argmax=cfg.screened_argmax and method != "target_fp32_head")
    return {"tokens": r.tokens, "seconds": r.total_s, "tau": r.tau, "accepted": r.accepted_by_position,
            "proposed": r.proposed_by_position, "passes": r.verify_passes, "committed": r.committed_by_verify,
            "draft_s": r.draft_s, "verify_s": r.verify_s}


def bench_prompts(cfg, tokenizer, context: Optional[int] = None) -> list[dict[str, Any]]:
    """The first user turns of `heldout_prompts` held-out conversations of `data` when there is no prompts_file, else
    the first max_prompts of prompts_file or of DEFAULT_PROMPTS."""
    if cfg.prompts_file is None and cfg.heldout_prompts > 0:
        from selfspec.data.tokenize import heldout_prompts

        return [{"messages": m} for m in heldout_prompts(cfg.data, tokenizer, cfg.heldout_prompts, context)]
    if cfg.prompts_file is None:
        items = [{"prompt": p} for p in DEFAULT_PROMPTS]
    else:
        items = read_prompts_file(cfg.prompts_file)
    return items[: cfg.max_prompts]


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per method, over its runs of every prompt: tau, tokens/s and speedup against the baseline (hf_greedy, else
    the target alone), whether its tokens equal the reference's (the target's, else hf_greedy's), peak memory, time
    per target pass and acceptance by draft position."""
    reference = runs["target"] if "target" in runs else runs.get("hf_greedy")
    baseline = runs.get("hf_greedy") or runs.get("target")
    summary: dict[str, Any] = {}
    base_all = sum(len(b["tokens"]) for b in baseline) / sum(b["seconds"] for b in baseline)
    for m, rs in runs.items():
        tps = [len(r["tokens"]) / r["seconds"] for r in rs]
        base_tps = [len(b["tokens"]) / b["seconds"] for b in baseline]
        passes = sum(r.get("passes") or 0 for r in rs)
        acc = _acceptance(rs)
        tps_all = sum(len(r["tokens"]) for r in rs) / sum(r["seconds"] for r in rs)
        summary[m] = {
            # over all passes of all prompts (tokens committed per target pass), as Spec-Bench counts it
            "tau": round(sum(r["committed"] for r in rs) / passes, 3) if passes else rs[0]["tau"],
            "tokens_per_s": round(tps_all, 2),
            "speedup": round(tps_all / base_all, 3),  # all tokens / all seconds, against the baseline's
            "speedup_mean_per_prompt": round(sum(a / b for a, b in zip(tps, base_tps)) / len(tps), 3),
            "identical": all(r["tokens"] == ref["tokens"] for r, ref in zip(rs, reference)) if reference else None,
            "peak_mb": round(max(r["peak_mb"] for r in rs), 1),
            # our loop's time per target pass: drafting (drafter calls) and verifying (the target's pass + accept)
            "draft_ms_per_pass": round(1e3 * sum(r["draft_s"] for r in rs) / passes, 2) if passes else None,
            "verify_ms_per_pass": round(1e3 * sum(r["verify_s"] for r in rs) / passes, 2) if passes else None,
            "accept_by_position": acc,
        }
    return summary


def head_verdict(cfg, summary: dict[str, Any]) -> list[str]:
    """Closing lines about `head=`: how long it trained, and whether train.max_minutes cut its schedule short (a
    question of this machine's speed, not of the recipe), then its best speedup among its own methods."""
    if cfg.head is None:
        return []
    from selfspec.heads.checkpoint import read_record

    training = read_record(cfg.head, cfg.head_revision).get("training", {})
    lines = []
    if "steps" in training:
        line = f"head {cfg.head}: {training['steps']} training steps in {(trained_seconds(training) or 0) / 60:.1f} min"
        if training.get("stopped_by"):
            line += (f"; {training['stopped_by']} stopped it at step {training['steps']} of "
                     f"{training['planned_steps']} (this machine trained slower than the recipe plans)")
        lines.append(line)
    mine = {m: s for m, s in summary.items() if m.removesuffix("_dyn").removesuffix("_tree") in names()}
    if mine:
        best = max(mine, key=lambda m: mine[m]["speedup"])
        base = "hf_greedy" if "hf_greedy" in summary else "target"
        lines.append(f"its best method here: {best}, {mine[best]['speedup']:.2f}x over {base} "
                     f"(tau {mine[best]['tau']:.2f})")
    return lines


def _acceptance(rs) -> Optional[list[float]]:
    acc = [r.get("accepted") for r in rs if r.get("accepted")]
    prop = [r.get("proposed") for r in rs if r.get("proposed")]
    if not prop:
        return None
    n = max(len(p) for p in prop)
    a = [sum(x[d] for x in acc if d < len(x)) for d in range(n)]
    p = [sum(x[d] for x in prop if d < len(x)) for d in range(n)]
    return [round(x / y, 3) if y else 0.0 for x, y in zip(a, p)]


def progress(iterable=None, **kw) -> tqdm:
    """A progress bar on stderr that vanishes when done (leave=False): stdout keeps only the lines and the table."""
    return tqdm(iterable, leave=False, file=sys.stderr, dynamic_ncols=True, **kw)


def short_config(cfg):
    """The same config with a short generation, for warm-up."""
    from omegaconf import OmegaConf

    c = OmegaConf.to_container(cfg, resolve=True)
    c["max_new_tokens"] = min(8, cfg.max_new_tokens)
    return OmegaConf.create(c)


def k_sweep(target, cfg, ids, eos) -> dict[str, dict[int, float]]:
    """Speedup over the target alone (our loop) vs chain length K, on one prompt, for the chain drafters."""
    chains = [m for m in cfg.methods if m in ("ngram", "draft_model", *names(), *cfg.heads)]
    if not chains:
        return {}
    base = run_method("target", target, None, ids, cfg, eos)
    base_tps = len(base["tokens"]) / base["seconds"]
    out: dict[str, dict[int, float]] = {}
    for m in chains:
        out[m] = {}
        for k in progress(cfg.sweep_k, desc=f"sweep K ({m})"):
            r = run_method(m, target, drafter_for(m, target, cfg, k), ids, cfg, eos)
            out[m][int(k)] = round(len(r["tokens"]) / r["seconds"] / base_tps, 3)
    return out


def tree_sweep(target, cfg, ids, eos) -> dict[str, dict[str, dict[str, float]]]:
    """tau and speedup over the target alone per tree shape (depth x top_k x total_tokens), first prompt only."""
    from omegaconf import OmegaConf

    trees = [m for m in cfg.methods if m.endswith("_tree")]
    base = run_method("target", target, None, ids, cfg, eos)
    base_tps = len(base["tokens"]) / base["seconds"]
    out: dict[str, dict[str, dict[str, float]]] = {}
    for m in trees:
        out[m] = {}
        for shape in progress(cfg.sweep_tree, desc=f"sweep tree ({m})"):
            depth, top_k, total = (int(x) for x in shape)
            c = OmegaConf.to_container(cfg, resolve=True)
            c["tree"] = {"depth": depth, "top_k": top_k, "total_tokens": total}
            r = run_method(m, target, drafter_for(m, target, OmegaConf.create(c)), ids, cfg, eos)
            out[m][f"{depth}x{top_k}x{total}"] = {"tau": round(r["tau"], 3),
                                                  "speedup": round(len(r["tokens"]) / r["seconds"] / base_tps, 3)}
    return out


def confidence_sweep(target, cfg, ids, eos) -> dict[str, dict[str, dict[str, float]]]:
    """tau and speedup over the target alone per min_confidence, first prompt only, for the `_dyn` methods."""
    base = run_method("target", target, None, ids, cfg, eos)
    base_tps = len(base["tokens"]) / base["seconds"]
    out: dict[str, dict[str, dict[str, float]]] = {}
    for m in [m for m in cfg.methods if m.endswith("_dyn")]:
        out[m] = {}
        for c in progress(cfg.sweep_confidence, desc=f"sweep min_confidence ({m})"):
            r = run_method(m, target, drafter_for(m, target, cfg, confidence=float(c)), ids, cfg, eos)
            out[m][str(c)] = {"tau": round(r["tau"], 3),
                              "speedup": round(len(r["tokens"]) / r["seconds"] / base_tps, 3)}
    return out


def print_table(summary: dict[str, Any]) -> None:
    print(f"{'method':<18}{'tau':>7}{'tok/s':>9}{'speedup':>9}{'per-prompt':>11}{'identical':>11}{'peak MB':>10}"
          f"{'draft ms':>10}{'verify ms':>10}")
    for m, s in summary.items():
        tau = f"{s['tau']:.2f}" if s["tau"] is not None else "-"
        ident = {True: "yes", False: "NO", None: "-"}[s["identical"]]
        print(f"{m:<18}{tau:>7}{s['tokens_per_s']:>9.2f}{s['speedup']:>8.2f}x{s['speedup_mean_per_prompt']:>10.2f}x"
              f"{ident:>11}{s['peak_mb']:>10.0f}{_ms(s['draft_ms_per_pass']):>10}{_ms(s['verify_ms_per_pass']):>10}")


def _ms(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.1f}"


def write_plots(summary: dict[str, Any], sweep: dict, out_dir: Path, overwrite: bool = False) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for m, s in summary.items():
        if s["accept_by_position"]:
            ax.plot(range(1, len(s["accept_by_position"]) + 1), s["accept_by_position"], marker="o", label=m)
    ax.set(xlabel="draft position", ylabel="share of passes accepting it", title="Acceptance by draft position",
           ylim=(0, 1.05))
    if ax.lines:
        ax.legend()
    fig.tight_layout()
    save_png(fig, out_dir / "acceptance_by_position.png", overwrite)
    plt.close(fig)
    if sweep:
        fig, ax = plt.subplots(figsize=(6, 4))
        for m, by_k in sweep.items():
            ks = sorted(by_k)
            ax.plot(ks, [by_k[k] for k in ks], marker="o", label=m)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(xlabel="draft length K", ylabel="speedup vs target alone", title="Speedup vs K")
        ax.legend()
        fig.tight_layout()
        save_png(fig, out_dir / "speedup_vs_k.png", overwrite)
        plt.close(fig)
