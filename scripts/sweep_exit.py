"""LayerSkip exit-layer sweep. For several exit layers E: held-out agreement, implied tau, measured costs, predicted
speedup.

    python scripts/sweep_exit.py [exit_layers=[4,6,8,10,12,15]] [train_minutes=0] [output_file=...]

For each E, an exit (untrained: the target's own norm + lm_head on layer E; or trained for `train_minutes` by
methods/layerskip/train.py) is evaluated on held-out prompts continued by the target's greedy decoding
(selfspec.eval.acceptance.exit_acceptance: top-1 agreement and the chain tau for K drafts). Its costs are measured on
this machine over a `context_tokens`-long cache, median of `repeats`, and give the predicted speedup: the costs and
the formula are in methods/layerskip/exit_sweep.py. With decode_tokens > 0 the real engine also runs one held-out prompt
with the layerskip chain (best K) and alone, for a measured speedup next to the prediction. Writes a JSON table
and a PNG plot next to it, each atomically, after every option is checked, and only over files this command wrote
unless overwrite=true, never over an input (core/ownership.py).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from selfspec.data.config import DataConfig
from selfspec.core.cli import entry, owned_output
from selfspec.core.ownership import PNG, Kind, json_keys
from selfspec.core.errors import UserError
from selfspec.target.model import TargetConfig, load_target_from_config
from selfspec.methods.layerskip.exit_sweep import FORMULA, Costs, exit_head, exit_row, measure, plot, row_line


@dataclass
class SweepExitConfig:
    """Schema of conf/sweep_exit.yaml."""

    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    exit_layers: list[int] = field(default_factory=lambda: [4, 6, 8, 10, 12, 15], metadata={"help": (
        "Exit layers to compare (each in 1..L-1).")})
    adapter: str = field(default="light", metadata={"help": (
        "Adapter of the exits (light | layer | lora) and the light adapter's rank.")})
    rank: int = field(default=64, metadata={"help": "adapter=light: the low-rank adapter's rank."})
    train_minutes: float = field(default=0.0, metadata={"help": (
        "Minutes of methods/layerskip/train.py per exit (0 = untrained exits: the target's norm + lm_head on layer "
        "E).")})
    train_overrides: list[str] = field(default_factory=list, metadata={"help": (
        'Extra methods/layerskip/train.py overrides for those runs (e.g. ["data.max_length=256"]).')})
    eval_prompts: int = field(default=4, metadata={"help": (
        "Held-out prompts and greedy tokens per prompt for the agreement/tau eval.")})
    eval_new_tokens: int = field(default=48, metadata={"help": "Greedy tokens per held-out prompt."})
    ks: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5, 6], metadata={"help": (
        "Chain lengths considered; the table reports K = chain_k and the K of the best predicted speedup.")})
    chain_k: int = field(default=5, metadata={"help": "The chain length K the table reports."})
    context_tokens: int = field(default=128, metadata={"help": (
        "Cost measurement: context length of the cache and repeats (median).")})
    repeats: int = field(default=7, metadata={"help": "Cost measurement: timed repeats (median)."})
    decode_tokens: int = field(default=0, metadata={"help": (
        ">0: also decode one held-out prompt for real (this many tokens) with the best K, and without a drafter.")})
    output_file: str = field(default="outputs/sweep_exit/sweep.json", metadata={"help": (
        "The JSON table; its .config.yaml, the PNG plot and trained exits go next to it.")})
    overwrite: bool = field(default=False, metadata={"help": (
        "Replace an existing table, config or plot there that this command did not write (never an input).")})


REPORT = Kind("sweep_exit table", folder=False, mine=json_keys("formula", "rows"))  # core/ownership.py


def plot_path(cfg) -> Path:
    """The plot beside the table (and its config): <output_file>.png."""
    return Path(cfg.output_file).with_suffix(".png")


def inputs(cfg) -> list[tuple[str, object]]:
    return [("data.path", cfg.data.path), ("data.features_dir", cfg.data.features_dir)]


@entry("sweep_exit", SweepExitConfig)
@torch.no_grad()  # restored on return: callers in the same process (tests) keep their gradient mode
def main(cfg) -> dict[str, Any]:
    out_file = Path(cfg.output_file)
    if not cfg.exit_layers:
        raise UserError("exit_layers is empty; e.g. exit_layers=[4,8]")
    for name in ("eval_prompts", "eval_new_tokens", "context_tokens", "repeats", "rank"):
        if getattr(cfg, name) < 1:
            raise UserError(f"{name} must be >= 1 (got {getattr(cfg, name)})")
    if not cfg.ks or min(cfg.ks) < 1:
        raise UserError(f"ks must be chain lengths >= 1 (got {list(cfg.ks)})")
    if cfg.chain_k not in cfg.ks:
        raise UserError(f"chain_k={cfg.chain_k} must be one of ks={list(cfg.ks)}")
    # the table, its config and the plot, each checked before anything is loaded
    with owned_output(cfg, out_file, "output_file", REPORT, inputs(cfg), also=[(plot_path(cfg), "plot", PNG)]) as tmp:
        report = sweep(cfg, out_file.parent)
        tmp.write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
    plot(report["rows"], cfg.chain_k, plot_path(cfg), cfg.overwrite)
    print(f"wrote {out_file} and {plot_path(cfg)}")
    return report


def sweep(cfg, exits_dir: Path) -> dict[str, Any]:
    """Every exit layer's row (its trained exit, if any, saved under `exits_dir`), printed as it comes."""
    from selfspec.eval.acceptance import eval_sequences, exit_acceptance

    target = load_target_from_config(cfg.target)
    n_layers = target.identity["num_hidden_layers"]
    bad = [e for e in cfg.exit_layers if not 1 <= e < n_layers]
    if bad:
        raise UserError(f"exit_layers {bad} outside 1..{n_layers - 1} for this {n_layers}-layer target")
    t0 = time.time()
    seqs = eval_sequences(cfg.data, target, cfg.eval_prompts, cfg.eval_new_tokens)
    print(f"[sweep] {len(seqs)} held-out greedy continuations ({time.time() - t0:.0f} s)", flush=True)
    costs = Costs(target.model, cfg.context_tokens, cfg.repeats)
    c_full = costs.full()
    rows = []
    for E in cfg.exit_layers:
        head = exit_head(target, E, cfg.adapter, cfg.rank, cfg.train_minutes, list(cfg.train_overrides), exits_dir)
        ev = exit_acceptance(head, target, seqs, max(cfg.ks))
        row = exit_row(E, ev, costs, c_full, head, list(cfg.ks))
        if cfg.decode_tokens > 0:
            row["measured"] = measure(target, head, seqs[0], row["best_k"], cfg.decode_tokens)
        rows.append(row)
        print(row_line(row, cfg.chain_k), flush=True)
        del head
    return {"target": target.identity, "adapter": cfg.adapter, "train_minutes": cfg.train_minutes,
            "eval_prompts": len(seqs), "eval_new_tokens": cfg.eval_new_tokens, "context_tokens": cfg.context_tokens,
            "formula": FORMULA, "threads": torch.get_num_threads(), "seconds": round(time.time() - t0, 1),
            "rows": rows}


if __name__ == "__main__":
    main()
