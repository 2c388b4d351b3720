"""Offline target features: what `scripts/cache_features.py` writes and `data.features=offline` trains from.

A features folder holds safetensors shards (each process writes its own) plus `index.json`. A shard packs its
sequences end to end: `input_ids` [N] int32, `loss_mask` [N] int8, `features` [N, H] (bf16/fp16 post-norm last
hidden states), optional `layer_<k>` [N, H] (un-normed residual stream after k layers, for EAGLE-3/LayerSkip),
and `offsets` [S+1] int64 (sequence s is rows offsets[s]:offsets[s+1]).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from safetensors import safe_open

from selfspec.core.errors import UserError
from selfspec.core.ownership import Kind
from selfspec.target.model import check_identity

INDEX = "index.json"
SHARD_PREFIX = "shard_"  # shard files: shard_<run tag>_r<rank>_<k>.safetensors


def _features_files(folder: Path) -> Optional[list[str]]:
    """The entries of `folder` scripts/cache_features.py wrote (core/ownership.py): its shards and per-rank shard
    lists, and index.json + config.yaml when the index is one of ours. None if there are none."""
    names = [p.name for p in folder.iterdir()]
    own = [n for n in names if (n.startswith(SHARD_PREFIX) and n.endswith(".safetensors"))
           or (n.startswith(".") and ".rank" in n and n.endswith(".json"))]
    try:
        index = json.loads((folder / INDEX).read_text())
    except (OSError, ValueError):
        index = None
    if isinstance(index, dict) and isinstance(index.get("shards"), list) and "target" in index:
        own += [INDEX, "config.yaml"]
    return own or None


FEATURES_KIND = Kind("features cache", folder=True, mine=_features_files)


class OfflineFeatures:
    """Sequences of a features folder, indexable like the tokenised dataset (plus a `features` entry, and a
    `layer_<k>` entry for each k in `layers`: the residual streams EAGLE-3 fuses)."""

    def __init__(self, folder: str | Path, target_identity: dict[str, Any], layers: Sequence[int] = ()):
        self.folder = Path(folder)
        self.layers = sorted({int(k) for k in layers})
        index_path = self.folder / INDEX
        if not index_path.exists():
            raise UserError(f"no {INDEX} in '{folder}'; write one with scripts/cache_features.py "
                            f"data.features_dir={folder}")
        try:
            self.index = json.loads(index_path.read_text())
        except ValueError as e:
            raise UserError(f"'{index_path}' is not valid JSON ({e}); rerun scripts/cache_features.py") from e
        check_identity(self.index["target"], target_identity, what="features cache")
        self._rows: list[tuple[int, int, int]] = []  # (shard, start, end)
        self._shards = []
        for k, shard in enumerate(self.index["shards"]):
            f = safe_open(str(self.folder / shard["file"]), "pt")
            offsets = f.get_tensor("offsets").tolist()
            missing = [layer for layer in self.layers if f"layer_{layer}" not in f.keys()]
            if missing:
                raise UserError(f"features cache '{folder}' has no layer_{missing[0]} (stored: "
                                f"{self.index.get('extra_layers', [])}); rerun scripts/cache_features.py with "
                                f"extra_layers=[{','.join(map(str, self.layers))}]")
            self._shards.append(f)
            self._rows += [(k, offsets[i], offsets[i + 1]) for i in range(len(offsets) - 1)]
        if not self._rows:
            raise UserError(f"features cache '{folder}' holds no sequences")

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        k, a, b = self._rows[i]
        f = self._shards[k]
        return {"input_ids": f.get_slice("input_ids")[a:b].tolist(),
                "loss_mask": f.get_slice("loss_mask")[a:b].tolist(), "features": f.get_slice("features")[a:b],
                **{f"layer_{n}": f.get_slice(f"layer_{n}")[a:b] for n in self.layers}}

    def token_rows(self):
        """(input_ids, loss_mask) of every sequence, without reading any features (e.g. for draft vocabularies)."""
        for k, a, b in self._rows:
            f = self._shards[k]
            yield f.get_slice("input_ids")[a:b].tolist(), f.get_slice("loss_mask")[a:b].tolist()

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def select(self, indices):
        return [self[i] for i in indices]


class FeatureMemo:
    """Online target features kept in RAM after a sequence's first use, so later epochs skip the target.

    `compute(ids [1, n])` runs the frozen target on ONE sequence, unpadded, and returns {name: [n, ...]}: floating
    tensors are rounded to bf16 (on first use as well, so a run resumed with an empty memo feeds the head exactly
    the values an uninterrupted run feeds it: exact resume holds), integer ones kept as they are. Each sequence runs
    alone, so what it gets depends neither on the sequences it is batched with nor on what the memo holds.
    """

    def __init__(self, max_gb: float, compute):
        self.max_bytes = int(max_gb * 2**30)
        self.compute = compute
        self.used = 0
        self.rows: dict[int, dict[str, torch.Tensor]] = {}

    @torch.no_grad()
    def __call__(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """{name: [B, T, ...]} for the batch's sequences (floats as fp32 values of bf16 numbers, zeros at pads)."""
        idx, lengths = batch["index"].tolist(), batch["attention_mask"].sum(-1).tolist()
        ids = batch["input_ids"]
        out: dict[str, torch.Tensor] = {}
        for b, (i, n) in enumerate(zip(idx, lengths)):
            row = self.rows.get(i)
            if row is None:
                row = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).cpu()
                       for k, v in self.compute(ids[b:b + 1, :n]).items()}
                size = sum(v.numel() * v.element_size() for v in row.values())
                if self.used + size <= self.max_bytes:
                    self.rows[i], self.used = row, self.used + size
            for k, v in row.items():
                if k not in out:
                    dtype = torch.float32 if v.is_floating_point() else v.dtype
                    out[k] = torch.zeros(len(idx), ids.shape[1], *v.shape[1:], dtype=dtype, device=ids.device)
                out[k][b, :n] = v.to(out[k].device, out[k].dtype)
        return out


def full_argmax(model, last: torch.Tensor) -> torch.Tensor:
    """The target's full-vocabulary argmax [n] from its (bf16-rounded) post-norm features `last` [n, H]: what
    soft_labels needs to score a position when the head drafts over a reduced vocabulary."""
    from selfspec.target.model import lm_logits

    with torch.profiler.record_function("target argmax"):  # a profiler range (scripts/profile_step.py)
        return lm_logits(model, last.to(model.dtype)).argmax(-1)


def last_features(model, argmax: bool = True):
    """FeatureMemo's compute for EAGLE-1: the post-norm last hidden states `features` [n, H] and, with `argmax`,
    the target's full-vocabulary argmax from them, `target_argmax` [n] (full_argmax)."""
    def compute(ids: torch.Tensor) -> dict[str, torch.Tensor]:
        with torch.profiler.record_function("target forward"):  # a profiler range (scripts/profile_step.py)
            feats = model.get_decoder()(input_ids=ids).last_hidden_state[0].to(torch.bfloat16)
        return {"features": feats, "target_argmax": full_argmax(model, feats)} if argmax else {"features": feats}

    return compute


def engine_layers(extra_layers: Sequence[int], n_layers: int) -> list[int]:
    """The residual streams to ask a serving engine for: `extra_layers` plus the last layer's (the post-norm
    `features` are made from it), sorted and without repeats (vLLM's order for its aux hidden states)."""
    return sorted({int(k) for k in extra_layers} | {n_layers})


@torch.no_grad()
def engine_features(states: torch.Tensor, layers: Sequence[int], n_layers: int, final_norm, store: torch.dtype,
                    extra_layers: Sequence[int]) -> dict[str, torch.Tensor]:
    """One sequence's cache entries from a serving engine's residual streams `states` [T, L, H] (column j = the
    state after layers[j] decoder layers, `engine_layers` order), in HF's conventions: `features` [T, H] = the
    target's final norm of the last layer's state (vLLM returns it un-normed), and `layer_<k>` [T, H] = HF
    hidden_states[k], which for k = n_layers is that same post-norm state (HF's last entry has the norm)."""
    column = {k: j for j, k in enumerate(layers)}
    weight = next(final_norm.parameters())
    last = final_norm(states[:, column[n_layers]].to(weight.device, weight.dtype))  # [T, H]
    out = {"features": last.to("cpu", store)}
    for k in extra_layers:
        out[f"layer_{k}"] = out["features"] if k == n_layers else states[:, column[k]].to("cpu", store)
    return out


class EngineFeatures:
    """The training set with its target features streamed from a serving engine (data.features=vllm): a row is
    computed by the engine when the loop asks for it and never stored, and reads like an OfflineFeatures row
    (`features`, `layer_<k>` for k in `layers`, bf16 like a cache), so every recipe trains from it unchanged.

    `dataset`: the tokenised rows (input_ids, loss_mask); `worker`: a running target.vllm_worker.VllmWorker started with
    engine_layers(layers, n_layers); `final_norm`: the target's (the last layer comes back without it)."""

    def __init__(self, dataset, worker, layers: Sequence[int], n_layers: int, final_norm):
        self.dataset, self.worker, self.final_norm = dataset, worker, final_norm
        self.layers, self.n_layers = sorted({int(k) for k in layers}), n_layers
        self.asked = engine_layers(self.layers, n_layers)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict[str, Any]:
        row = self.dataset[i]
        states = self.worker.hidden_states([list(row["input_ids"])])[0]  # [T, L, H]
        return {"input_ids": list(row["input_ids"]), "loss_mask": list(row["loss_mask"]),
                **engine_features(states, self.asked, self.n_layers, self.final_norm, torch.bfloat16, self.layers)}

    def token_rows(self):
        return ((r["input_ids"], r["loss_mask"]) for r in self.dataset)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def select(self, indices):
        return [self[i] for i in indices]


def write_shard(path: Path, sequences: list[dict[str, torch.Tensor]], extra_layers: list[int]) -> dict[str, int]:
    """Pack `sequences` ({input_ids, loss_mask, features, layer_<k>...}) into one shard, atomically: a temp file
    beside it (selfspec.core.atomic.atomic_path: safetensors writes to a path), fsynced, renamed over it, the folder
    fsynced."""
    from safetensors.torch import save_file

    from selfspec.core.atomic import atomic_path

    offsets = [0]
    for s in sequences:
        offsets.append(offsets[-1] + len(s["input_ids"]))
    tensors = {
        "input_ids": torch.cat([s["input_ids"] for s in sequences]).to(torch.int32),
        "loss_mask": torch.cat([s["loss_mask"] for s in sequences]).to(torch.int8),
        "features": torch.cat([s["features"] for s in sequences]),
        "offsets": torch.tensor(offsets, dtype=torch.int64),
        **{f"layer_{k}": torch.cat([s[f"layer_{k}"] for s in sequences]) for k in extra_layers},
    }
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp))
    return {"sequences": len(sequences), "tokens": offsets[-1], "bytes": path.stat().st_size}


def remove_unlisted(folder: Path, keep: Sequence[str]) -> None:
    """Delete the shards of `folder` its index does not list, and the temp files of killed writes (the caller holds
    the folder's writer lock, and has just written the index that lists `keep`)."""
    from selfspec.core.atomic import TMP

    for p in folder.iterdir():
        ours = ((p.name.startswith(SHARD_PREFIX) and p.suffix == ".safetensors")  # shards
                or (p.name.startswith(".") and TMP in p.name)  # killed writes
                or (p.name.startswith(".") and ".rank" in p.name and p.suffix == ".json"))  # per-rank shard lists
        if ours and p.is_file() and p.name not in keep:
            p.unlink(missing_ok=True)
