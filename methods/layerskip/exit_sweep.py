"""LayerSkip exits compared at several exit layers E: measured costs, the chain tau and the predicted speedup (what
scripts/sweep_exit.py tabulates and plots).

Costs are measured on this machine, one token at a time over a `context`-long cache, median of `repeats`:

    c_full      one plain decoding step: layers 0..L-1 + norm + lm_head over 1 token
    c_prefix    layers 0..E-1 over 1 token (a draft step, writing the target's own cache)
    c_exit      adapter + norm + lm_head over 1 token
    c_verify(K) layers E..L-1 + norm + lm_head over K + 1 tokens (verification reusing layers < E)

A chain of K costs (K + 1) c_prefix + K c_exit + c_verify(K) per round (the extra prefix step computes the last
draft's layer-E state) and commits tau_K tokens on average, against tau_K c_full for plain decoding:

    predicted speedup(E, K) = tau_K * c_full / ((K + 1) * c_prefix + K * c_exit + c_verify(K))

(bookkeeping and Python overheads ignored). `measure` runs the real engine for a measured speedup next to it.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Sequence

import torch

from selfspec.core.errors import UserError
from selfspec.core.ownership import save_png

FORMULA = "tau_K * c_full / ((K+1) * c_prefix + K * c_exit + c_verify(K))"  # the module docstring's, for the table
# The recipe that trains the exits when train_minutes > 0, run by path as its own process (see exit_head).
LAYERSKIP_RECIPE = Path(__file__).resolve().parent / "train.py"


class Costs:
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
        self.full()  # a whole warm-up round: right after the prefill the first ~8 steps ran ~40 % slow (121 vs 85 ms)

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
        from selfspec.heads.layers import run_layers

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
        from selfspec.heads.layers import run_layers

        pos, mask = self._mask(T)
        emb = self.model.get_input_embeddings()
        h = run_layers(self.model, emb(self.ids[:, self.n:self.n + T]), 0, E, pos[None], None,
                       self.kv.attention_mask(self.cfg, 0, torch.ones(T, T, dtype=torch.bool).tril(), pos - self.n,
                                              self.dtype))

        def step():
            # layers < E hold the T tokens too (their keys are not read by layers >= E: only the length matters)
            self.kv.decoder_forward_from(self.model, E, h, pos[None], self.cache, mask)

        return self._time(step)


def exit_row(E: int, ev: dict, costs: Costs, c_full: float, head, ks: list[int]) -> dict:
    """One exit's row of the table: its agreement (ev: eval/acceptance.exit_acceptance to depth max(ks)), the chain
    tau for each K, its measured costs and the predicted speedup for each K (the module docstring's formula)."""
    cond = [ev.get(f"acc@{d}", 0.0) for d in range(1, max(ks) + 1)]
    cum, tau = 1.0, {}
    for k in range(1, max(ks) + 1):
        cum *= cond[k - 1]
        tau[k] = (tau.get(k - 1, 1.0)) + cum
    c_prefix, c_exit = costs.prefix(E), costs.exit(head)
    pred = {}
    verify = {}
    for k in ks:
        verify[k] = costs.verify(E, k + 1)
        pred[k] = tau[k] * c_full / ((k + 1) * c_prefix + k * c_exit + verify[k])
    best = max(ks, key=lambda k: pred[k])
    return {"exit_layer": E, "top1": ev["top1"], "chains": ev["chains"],
            "tau": {k: round(tau[k], 3) for k in ks}, "c_full_ms": round(1e3 * c_full, 2),
            "c_prefix_ms": round(1e3 * c_prefix, 2), "c_exit_ms": round(1e3 * c_exit, 2),
            "c_verify_ms": {k: round(1e3 * v, 2) for k, v in verify.items()},
            "draft_cost_per_token": round((c_prefix + c_exit) / c_full, 3),
            "predicted_speedup": {k: round(v, 3) for k, v in pred.items()}, "best_k": best}


def exit_head(target, exit_layer: int, adapter: str, rank: int, train_minutes: float = 0.0,
              train_overrides: Sequence[str] = (), folder: Path = Path(".")):
    """An untrained exit at `exit_layer` (the target's norm + lm_head on that layer, through `adapter`), or one
    trained by methods/layerskip/train.py for `train_minutes` (plus `train_overrides`) into folder/E<exit_layer>,
    reloaded from its head folder.

    Training runs the recipe as its own process, as a user launches it (`python methods/layerskip/train.py overrides`):
    recipes are leaves that nothing imports, and a run's accelerator state stays out of the sweep's process."""
    import subprocess
    import sys

    from selfspec.methods.layerskip.head import build_layerskip

    if train_minutes <= 0:
        return build_layerskip(target.model, exit_layer=exit_layer, adapter=adapter, rank=rank).eval()
    from selfspec.heads.checkpoint import load_head

    run = folder / f"E{exit_layer}"
    name = target.identity["name_or_path"]
    overrides = [f"target.name_or_path={name}", f"draft.exit_layer={exit_layer}", f"draft.adapter={adapter}",
                 f"draft.rank={rank}", f"train.max_minutes={train_minutes}", "train.epochs=100",
                 "train.eval_every=0", "train.eval_prompts=0", "train.save_every=0", "train.schedule=constant",
                 f"output_dir={run}", *train_overrides]
    done = subprocess.run([sys.executable, str(LAYERSKIP_RECIPE), *overrides])
    if done.returncode != 0:
        raise UserError(f"training the exit at layer {exit_layer} failed (exit status {done.returncode}; its error is "
                        f"above)")
    return load_head(str(run / "head"), target)


def row_line(row: dict, k: int) -> str:
    """One row of the table as the sweep prints it: agreement, tau and costs at K=k, the predicted speedup at k and
    at the best K, and the measured one if any."""
    m = row.get("measured")
    meas = (f" | measured K={m['k']}: tau {m['tau']:.2f} speedup {m['speedup']:.2f}x identical={m['identical']}"
            if m else "")
    return (f"E={row['exit_layer']:>2} top1 {row['top1']:.3f} tau@{k} {row['tau'][k]:.2f} | draft "
            f"{row['c_prefix_ms']:.1f}+{row['c_exit_ms']:.1f} ms vs full {row['c_full_ms']:.1f} ms "
            f"({row['draft_cost_per_token']:.2f}x) verify@{k} "
            f"{row['c_verify_ms'][k]:.1f} ms | predicted {row['predicted_speedup'][k]:.2f}x @K={k}, best "
            f"{row['predicted_speedup'][row['best_k']]:.2f}x @K={row['best_k']}{meas}")


def measure(target, head, seq, k: int, new: int) -> dict:
    """The real engine on one held-out prompt: `new` tokens with the exit's chain of k drafts, and the target alone."""
    from selfspec.methods.layerskip.drafter import LayerSkipDrafter
    from selfspec.decode.engine import generate

    ids, start = seq
    prompt = ids[0, :start].tolist()
    base = generate(target, None, prompt, new, eos_token_ids=[])
    drafter = LayerSkipDrafter(head, target.model.get_output_embeddings().weight.shape[0], num_draft=k)
    r = generate(target, drafter, prompt, new, eos_token_ids=[])
    return {"k": k, "tau": round(r.tau, 3), "tokens_per_s": round(r.tokens_per_s, 2),
            "target_tokens_per_s": round(base.tokens_per_s, 2), "speedup": round(r.tokens_per_s / base.tokens_per_s, 3),
            "identical": r.tokens == base.tokens}


def plot(rows: list[dict], k: int, path: Path, overwrite: bool = False) -> None:
    """The table as a PNG: agreement and draft cost, and the predicted (and measured) speedup, against E."""
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
        b.plot([r["exit_layer"] for r in rows if "measured" in r],
               [r["measured"]["speedup"] for r in rows if "measured" in r],
               marker="x", ls="--", label="measured (1 prompt, best K)")
    b.axhline(1.0, color="grey", lw=0.8)
    b.set(xlabel="exit layer E", ylabel="speedup vs plain decoding", title="Self-speculation speedup")
    b.legend()
    fig.tight_layout()
    save_png(fig, path, overwrite)
    plt.close(fig)
