"""Writing a features cache (what scripts/cache_features.py runs; data/features.py reads it and owns the shard layout).

Each process runs the frozen target under no_grad over every world-th sequence (cache_hf; or vLLM's residual streams,
one process: cache_vllm) and writes its own safetensors shards, named with the run's tag; rank 0 then writes
index.json (target identity, shards, bytes per token) last (write_index), so a folder with an index is complete.
The previous cache (its index and shards) stays complete and readable until the new index replaces it atomically,
and only then are the previous shards deleted: a killed run leaves the old cache as it was, plus shards the next run
removes.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from selfspec.core.atomic import write_json
from selfspec.core.cli import save_config
from selfspec.target.model import local_folder
from selfspec.data.features import INDEX, SHARD_PREFIX, remove_unlisted, write_shard


def cache_hf(cfg, acc, target, ds, out: Path, store, tag: str) -> dict:
    """Run the target over this rank's sequences into shards tagged `tag`; rank 0 then writes the index."""
    mine = list(range(acc.process_index, len(ds), acc.num_processes))
    shards, tokens = Shards(out, tag, acc.process_index, cfg), 0
    t0 = time.time()
    bar = tqdm(total=len(mine), desc=f"features (rank {acc.process_index})", disable=not acc.is_local_main_process)
    for i in mine:
        row = ds[i]
        ids = torch.tensor([row["input_ids"]], device=acc.device)
        with torch.no_grad():
            out_h = target.model.get_decoder()(input_ids=ids, output_hidden_states=bool(cfg.extra_layers))
        seq = {"input_ids": ids[0].cpu(), "loss_mask": torch.tensor(row["loss_mask"]),
               "features": out_h.last_hidden_state[0].to("cpu", store)}
        for k in cfg.extra_layers:
            seq[f"layer_{k}"] = out_h.hidden_states[k][0].to("cpu", store)
        shards.add(seq, ids.shape[1])
        tokens += ids.shape[1]
        bar.update(1)
        bar.set_postfix(tok_s=f"{tokens / (time.time() - t0):.0f}")
    bar.close()
    return write_index(cfg, acc, target, out, tag, shards.close(), tokens, time.time() - t0)


def cache_vllm(cfg, acc, target, ds, out: Path, store, tag: str) -> dict:
    """The same shards from vLLM's residual streams (target/vllm_worker.py), `batch_size` sequences per request; the
    last layer's state is always asked for (the post-norm `features`: data.features.engine_features)."""
    from selfspec.target.vllm_worker import VllmWorker
    from selfspec.data.features import engine_features, engine_layers

    n_layers = target.identity["num_hidden_layers"]
    layers = engine_layers(cfg.extra_layers, n_layers)
    norm = target.model.get_decoder().norm
    longest = max(len(ids) for ids in ds["input_ids"])
    shards, tokens = Shards(out, tag, acc.process_index, cfg), 0
    folder = local_folder(cfg.target.name_or_path, cfg.target.cache_dir)
    print(f"[selfspec] starting vLLM on {folder} (layers {layers}) ...", flush=True)
    with VllmWorker(cfg.vllm_python, str(folder), max_model_len=longest + 1, layers=layers,
                    dtype=cfg.target.dtype) as worker:
        t0 = time.time()
        bar = tqdm(total=len(ds), desc="features (vLLM)")
        for start in range(0, len(ds), cfg.batch_size):
            rows = [ds[i] for i in range(start, min(start + cfg.batch_size, len(ds)))]
            for row, states in zip(rows, worker.hidden_states([list(r["input_ids"]) for r in rows])):
                seq = {"input_ids": torch.tensor(row["input_ids"]), "loss_mask": torch.tensor(row["loss_mask"]),
                       **engine_features(states, layers, n_layers, norm, store, cfg.extra_layers)}
                shards.add(seq, len(row["input_ids"]))
                tokens += len(row["input_ids"])
            bar.update(len(rows))
            bar.set_postfix(tok_s=f"{tokens / (time.time() - t0):.0f}")
        bar.close()
        seconds = time.time() - t0
    return write_index(cfg, acc, target, out, tag, shards.close(), tokens, seconds, vllm=worker.vllm_version)


def write_index(cfg, acc, target, out: Path, tag: str, shards, tokens: int, seconds: float, **extra) -> dict:
    """Every rank lists its shards; rank 0 then writes index.json (the switch to this run's cache)."""
    write_json(out / f".{tag}.rank{acc.process_index}.json", shards, indent=None)
    acc.wait_for_everyone()
    summary = {}
    if acc.is_main_process:
        all_shards = []
        for r in range(acc.num_processes):
            all_shards += json.loads((out / f".{tag}.rank{r}.json").read_text())
        n_tok = sum(s["tokens"] for s in all_shards)
        summary = {"sequences": sum(s["sequences"] for s in all_shards), "tokens": n_tok,
                   "bytes_per_token": round(sum(s["bytes"] for s in all_shards) / max(n_tok, 1), 1),
                   "tokens_per_s": round(tokens * acc.num_processes / max(seconds, 1e-9), 1), "dtype": cfg.dtype,
                   "extra_layers": list(cfg.extra_layers), "engine": cfg.engine, **extra}
        index = {"target": target.identity, "shards": all_shards, **summary}
        write_json(out / INDEX, index, indent=1)  # the switch: from here on the folder is this run's cache
        remove_unlisted(out, [s["file"] for s in all_shards])  # the previous run's shards and our rank files
        save_config(cfg, out / "config.yaml")  # how this cache was made
        print(json.dumps(summary))
    acc.wait_for_everyone()
    return summary


class Shards:
    """This rank's sequences, written as a shard file each time `shard_tokens` tokens are pending (and at close)."""

    def __init__(self, out: Path, tag: str, rank: int, cfg):
        self.out, self.tag, self.rank, self.cfg = out, tag, rank, cfg
        self.written: list[dict] = []
        self.pending, self.pending_tokens = [], 0

    def add(self, seq: dict, n_tokens: int) -> None:
        self.pending.append(seq)
        self.pending_tokens += n_tokens
        if self.pending_tokens >= self.cfg.shard_tokens:
            self._flush()

    def close(self) -> list[dict]:
        if self.pending:
            self._flush()
        return self.written

    def _flush(self) -> None:
        name = f"{SHARD_PREFIX}{self.tag}_r{self.rank:02d}_{len(self.written):05d}.safetensors"
        self.written.append({"file": name, **write_shard(self.out / name, self.pending, list(self.cfg.extra_layers))})
        self.pending, self.pending_tokens = [], 0
