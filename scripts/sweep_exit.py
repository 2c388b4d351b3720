"""LayerSkip exit-layer sweep. For several exit layers E: held-out agreement, implied tau, measured costs, predicted speedup.

    python scripts/sweep_exit.py [exit_layers=[4,6,8,10,12,15]] [train_minutes=0] [output_file=...]

For each E, an exit (untrained: the target's own norm + lm_head on layer E; or trained for `train_minutes` by
train/layerskip.py) is evaluated on held-out prompts continued by the target's greedy decoding
(selfspec.eval.acceptance.exit_acceptance: top-1 agreement and the chain tau for K drafts). Costs are measured on
this machine, one token at a time over a `context_tokens`-long cache, median of `repeats`:

    c_full      one plain decoding step: layers 0..L-1 + norm + lm_head over 1 token
    c_prefix    layers 0..E-1 over 1 token (a draft step, writing the target's own cache)
    c_exit      adapter + norm + lm_head over 1 token
    c_verify(K) layers E..L-1 + norm + lm_head over K + 1 tokens (verification reusing layers < E)

A chain of K costs (K + 1) c_prefix + K c_exit + c_verify(K) per round (the extra prefix step computes the last
draft's layer-E state) and commits tau_K tokens on average, against tau_K c_full for plain decoding:

    predicted speedup(E, K) = tau_K * c_full / ((K + 1) * c_prefix + K * c_exit + c_verify(K))

(bookkeeping and Python overheads ignored). With decode_tokens > 0 the real engine also runs one held-out prompt
with the layerskip chain (best K) and alone, for a measured speedup next to the prediction. Writes a JSON table
and a PNG plot next to it, each atomically, after every option is checked, and only over files this command wrote
unless overwrite=true, never over an input (core/ownership.py).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from selfspec.data.config import DataConfig
from selfspec.core.cli import config_path, entry, save_config
from selfspec.core.ownership import PNG, PNG_SOFTWARE, Kind, check_output, config_kind, json_keys, owned_path
from selfspec.core.errors import UserError
from selfspec.core.target import TargetConfig, load_target_from_config

# The recipe that trains the exits when train_minutes > 0, run by path as its own process (see _exit).
LAYERSKIP_RECIPE = Path(__file__).resolve().parents[1] / "train" / "layerskip.py"


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
        "Minutes of train/layerskip.py per exit (0 = untrained exits: the target's norm + lm_head on layer E).")})
    train_overrides: list[str] = field(default_factory=list, metadata={"help": (
        'Extra train/layerskip.py overrides for those runs (e.g. ["data.max_length=256"]).')})
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


def outputs(cfg) -> list[tuple[Path, str, Kind]]:
    """Every file a run writes beside its trained exits: the table, its config, the plot."""
    out = Path(cfg.output_file)
    return [(out, "output_file", REPORT), (config_path(out), "output_file's config", config_kind(cfg)),
            (out.with_suffix(".png"), "plot", PNG)]


def inputs(cfg) -> list[tuple[str, object]]:
    return [("data.path", cfg.data.path), ("data.features_dir", cfg.data.features_dir)]


@entry("sweep_exit", SweepExitConfig)
@torch.no_grad()  # restored on return: callers in the same process (tests) keep their gradient mode
def main(cfg) -> dict[str, Any]:
    from selfspec.decode.drafters.layerskip import LayerSkipDrafter
    from selfspec.decode.engine import generate
    from selfspec.eval.acceptance import eval_sequences, exit_acceptance

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
    for path, what, kind in outputs(cfg):  # before anything is loaded; each again when it is written
        check_output(path, what, kind, cfg.overwrite, inputs(cfg))
    target = load_target_from_config(cfg.target)
    n_layers = target.identity["num_hidden_layers"]
    bad = [e for e in cfg.exit_layers if not 1 <= e < n_layers]
    if bad:
        raise UserError(f"exit_layers {bad} outside 1..{n_layers - 1} for this {n_layers}-layer target")
    t0 = time.time()
    seqs = eval_sequences(cfg.data, target, cfg.eval_prompts, cfg.eval_new_tokens)
    print(f"[sweep] {len(seqs)} held-out greedy continuations ({time.time() - t0:.0f} s)", flush=True)
    model = target.model
    costs = _Costs(model, cfg.context_tokens, cfg.repeats)
    c_full = costs.full()
    rows = []
    for E in cfg.exit_layers:
        head = _exit(cfg, target, E, out_file.parent)
        ev = exit_acceptance(head, target, seqs, max(cfg.ks))
        cond = [ev.get(f"acc@{d}", 0.0) for d in range(1, max(cfg.ks) + 1)]
        cum, tau = 1.0, {}
        for k in range(1, max(cfg.ks) + 1):
            cum *= cond[k - 1]
            tau[k] = (tau.get(k - 1, 1.0)) + cum
        c_prefix, c_exit = costs.prefix(E), costs.exit(head)
        pred = {}
        verify = {}
        for k in cfg.ks:
            verify[k] = costs.verify(E, k + 1)
            pred[k] = tau[k] * c_full / ((k + 1) * c_prefix + k * c_exit + verify[k])
        best = max(cfg.ks, key=lambda k: pred[k])
        row = {"exit_layer": E, "top1": ev["top1"], "chains": ev["chains"],
               "tau": {k: round(tau[k], 3) for k in cfg.ks}, "c_full_ms": round(1e3 * c_full, 2),
               "c_prefix_ms": round(1e3 * c_prefix, 2), "c_exit_ms": round(1e3 * c_exit, 2),
               "c_verify_ms": {k: round(1e3 * v, 2) for k, v in verify.items()},
               "draft_cost_per_token": round((c_prefix + c_exit) / c_full, 3),
               "predicted_speedup": {k: round(v, 3) for k, v in pred.items()}, "best_k": best}
        if cfg.decode_tokens > 0:
            row["measured"] = _measure(target, head, seqs[0], best, cfg.decode_tokens, generate, LayerSkipDrafter)
        rows.append(row)
        _print_row(row, cfg.chain_k)
        del head
    report = {"target": target.identity, "adapter": cfg.adapter, "train_minutes": cfg.train_minutes,
              "eval_prompts": len(seqs), "eval_new_tokens": cfg.eval_new_tokens, "context_tokens": cfg.context_tokens,
              "formula": "tau_K * c_full / ((K+1) * c_prefix + K * c_exit + c_verify(K))",
              "threads": torch.get_num_threads(), "seconds": round(time.time() - t0, 1), "rows": rows}
    with owned_path(out_file, "output_file", REPORT, cfg.overwrite, inputs(cfg)) as tmp:
        tmp.write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
    save_config(cfg, config_path(out_file), cfg.overwrite)
    _plot(rows, cfg.chain_k, out_file.with_suffix(".png"), cfg.overwrite)
    print(f"wrote {out_file} and {out_file.with_suffix('.png')}")
    return report


def _exit(cfg, target, E: int, folder: Path):
    """An untrained exit, or one trained for train_minutes into folder/E<E> (reloaded from its head folder).

    Training runs the recipe as its own process, as a user launches it (`python train/layerskip.py overrides`):
    recipes are leaves that nothing imports, and a run's accelerator state stays out of the sweep's process."""
    import subprocess
    import sys

    from selfspec.heads.layerskip import build_layerskip

    if cfg.train_minutes <= 0:
        return build_layerskip(target.model, exit_layer=E, adapter=cfg.adapter, rank=cfg.rank).eval()
    from selfspec.heads.checkpoint import load_head

    run = folder / f"E{E}"
    name = target.identity["name_or_path"]
    overrides = [f"target.name_or_path={name}", f"draft.exit_layer={E}", f"draft.adapter={cfg.adapter}",
                 f"draft.rank={cfg.rank}", f"train.max_minutes={cfg.train_minutes}", "train.epochs=100",
                 "train.eval_every=0", "train.eval_prompts=0", "train.save_every=0", "train.schedule=constant",
                 f"output_dir={run}", *cfg.train_overrides]
    done = subprocess.run([sys.executable, str(LAYERSKIP_RECIPE), *overrides])
    if done.returncode != 0:
        raise UserError(f"training the exit at layer {E} failed (exit status {done.returncode}; its error is above)")
    return load_head(str(run / "head"), target)


class _Costs:
    """Median seconds of the pieces of a draft/verify round, over a `context`-long cache of random tokens."""

    def __init__(self, model, context: int, repeats: int):
        from selfspec.decode import kv

        self.kv, self.model, self.repeats = kv, model, repeats
        self.cfg = kv.text_config(model)
        self.dtype = next(model.parameters()).dtype
        self.n = context
        g = torch.Generator().manual_seed(0)
        vocab = model.get_output_embeddings().weight.shape[0]
        self.ids = torch.randint(0, vocab, (1, context + 8), generator=g)
        self.cache = kv.new_cache()
        pos = torch.arange(context)
        kv.decoder_forward(model, self.ids[:, :context], pos[None], self.cache,
                           kv.attention_mask(self.cfg, 0, torch.ones(context, context, dtype=torch.bool).tril(), pos,
                                             self.dtype))

    def _time(self, fn) -> float:
        ts = []
        for _ in range(self.repeats + 1):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
            self.kv.truncate(self.cache, self.n)
        return statistics.median(ts[1:])  # the first run warms up

    def _mask(self, T: int):
        pos = torch.arange(self.n, self.n + T)
        return pos, self.kv.attention_mask(self.cfg, self.n, torch.ones(T, T, dtype=torch.bool).tril(), pos, self.dtype)

    def full(self) -> float:
        pos, mask = self._mask(1)
        return self._time(lambda: self.kv.decoder_forward(self.model, self.ids[:, self.n:self.n + 1], pos[None],
                                                          self.cache, mask))

    def prefix(self, E: int) -> float:
        from selfspec.heads.layerskip import run_layers

        pos, mask = self._mask(1)
        emb = self.model.get_input_embeddings()
        return self._time(lambda: run_layers(self.model, emb(self.ids[:, self.n:self.n + 1]), 0, E, pos[None],
                                             self.cache, mask))

    def exit(self, head) -> float:
        h = torch.randn(1, 1, self.cfg.hidden_size, dtype=self.dtype)
        pos = torch.tensor([[self.n]])
        return self._time(lambda: head.logits(head(h, pos)))

    def verify(self, E: int, T: int) -> float:
        """Layers E..L-1 over T tokens, after layers < E hold them (as self-speculation leaves the cache)."""
        from selfspec.heads.layerskip import run_layers

        pos, mask = self._mask(T)
        emb = self.model.get_input_embeddings()
        h = run_layers(self.model, emb(self.ids[:, self.n:self.n + T]), 0, E, pos[None], None,
                       self.kv.attention_mask(self.cfg, 0, torch.ones(T, T, dtype=torch.bool).tril(), pos - self.n,
                                              self.dtype))

        def step():
            # layers < E hold the T tokens too (their keys are not read by layers >= E: only the length matters)
            self.kv.decoder_forward_from(self.model, E, h, pos[None], self.cache, mask)

        return self._time(step)


def _measure(target, head, seq, k: int, new: int, generate, drafter_cls) -> dict:
    ids, start = seq
    prompt = ids[0, :start].tolist()
    base = generate(target, None, prompt, new, eos_token_ids=[])
    drafter = drafter_cls(head, target.model.get_output_embeddings().weight.shape[0], num_draft=k)
    r = generate(target, drafter, prompt, new, eos_token_ids=[])
    return {"k": k, "tau": round(r.tau, 3), "tokens_per_s": round(r.tokens_per_s, 2),
            "target_tokens_per_s": round(base.tokens_per_s, 2), "speedup": round(r.tokens_per_s / base.tokens_per_s, 3),
            "identical": r.tokens == base.tokens}


def _print_row(row: dict, k: int) -> None:
    m = row.get("measured")
    meas = f" | measured K={m['k']}: tau {m['tau']:.2f} speedup {m['speedup']:.2f}x identical={m['identical']}" if m else ""
    print(f"E={row['exit_layer']:>2} top1 {row['top1']:.3f} tau@{k} {row['tau'][k]:.2f} | draft {row['c_prefix_ms']:.1f}+"
          f"{row['c_exit_ms']:.1f} ms vs full {row['c_full_ms']:.1f} ms ({row['draft_cost_per_token']:.2f}x) verify@{k} "
          f"{row['c_verify_ms'][k]:.1f} ms | predicted {row['predicted_speedup'][k]:.2f}x @K={k}, best "
          f"{row['predicted_speedup'][row['best_k']]:.2f}x @K={row['best_k']}{meas}", flush=True)


def _plot(rows: list[dict], k: int, path: Path, overwrite: bool = False) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    es = [r["exit_layer"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(es, [r["top1"] for r in rows], marker="o", label="top-1 agreement")
    a.plot(es, [r["draft_cost_per_token"] for r in rows], marker="s", label="draft cost / full step")
    a.set(xlabel="exit layer E", ylim=(0, 1.05), title="Agreement and draft cost")
    a.legend()
    b.plot(es, [r["predicted_speedup"][k] for r in rows], marker="o", label=f"predicted, K={k}")
    b.plot(es, [r["predicted_speedup"][r["best_k"]] for r in rows], marker="^", label="predicted, best K")
    if any("measured" in r for r in rows):
        b.plot([r["exit_layer"] for r in rows if "measured" in r], [r["measured"]["speedup"] for r in rows if "measured" in r],
               marker="x", ls="--", label="measured (1 prompt, best K)")
    b.axhline(1.0, color="grey", lw=0.8)
    b.set(xlabel="exit layer E", ylabel="speedup vs plain decoding", title="Self-speculation speedup")
    b.legend()
    fig.tight_layout()
    with owned_path(path, "plot", PNG, overwrite) as tmp:  # marked as selfspec's, like bench.save_png
        fig.savefig(tmp, format="png", dpi=120, metadata={"Software": f"{PNG_SOFTWARE} (matplotlib)"})
    plt.close(fig)


if __name__ == "__main__":
    main()
