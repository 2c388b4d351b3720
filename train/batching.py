"""Deterministic, resumable batches. Process r of w owns a fixed shard of the examples (a split seeded by `seed`
alone), so a per-process cache such as the feature memo holds every example its process will see again; epoch e
visits the shard in an order seeded by (seed, e). Resuming at (epoch, batch) replays exactly the batches not yet
seen."""

from __future__ import annotations

from typing import Iterator

import torch


def epoch_batches(num_examples: int, batch_size: int, epoch: int, seed: int, rank: int = 0,
                  world: int = 1) -> list[list[int]]:
    """Example indices of this process's batches in `epoch` (every process gets the same count)."""
    # One process keeps every example in place (its order is then what it was before shards existed).
    split = torch.randperm(num_examples, generator=torch.Generator().manual_seed(seed)).tolist() if world > 1 \
        else list(range(num_examples))
    shard = split[rank::world][: num_examples // world]  # equal shards keep the processes in lockstep
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = [shard[i] for i in torch.randperm(len(shard), generator=g).tolist()]
    return [order[i:i + batch_size] for i in range(0, len(order) - batch_size + 1, batch_size)]


def collate(rows: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest row: input_ids [B, T], attention_mask [B, T], loss_mask [B, T] (+ features
    [B, T, H] and layer_<k> [B, T, H] when the rows carry precomputed target features)."""
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    loss = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.as_tensor(r["input_ids"])
        attn[i, :n] = 1
        loss[i, :n] = torch.as_tensor(r["loss_mask"])
    batch = {"input_ids": ids, "attention_mask": attn, "loss_mask": loss}
    for key in [k for k in rows[0] if k == "features" or k.startswith("layer_")]:  # per-token [n, H] tensors
        feats = torch.zeros(len(rows), width, rows[0][key].shape[-1], dtype=rows[0][key].dtype)
        for i, r in enumerate(rows):
            feats[i, : len(r["input_ids"])] = r[key]
        batch[key] = feats
    return batch


def iterate(dataset, batch_size: int, epoch: int, seed: int, rank: int, world: int, pad_id: int,
            start: int = 0) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """(batch index, collated batch) for this process, from batch `start` of `epoch` on. The batch carries
    `index` [B]: the dataset rows it holds (for per-example caches)."""
    for i, idx in enumerate(epoch_batches(len(dataset), batch_size, epoch, seed, rank, world)):
        if i >= start:
            yield i, {**collate([dataset[j] for j in idx], pad_id), "index": torch.tensor(idx)}
