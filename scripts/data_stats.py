"""Summarise what a data config yields for a target: conversations, tokens, loss tokens, skipped records.

    python scripts/data_stats.py data=sharegpt target=smollm2-135m [data.max_conversations=1000]

Prints a few readable lines, then one JSON object on the last line.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from selfspec.data.config import DataConfig
from selfspec.data.conversations import load_conversations, select_split
from selfspec.data.tokenize import check_max_length, tokenize_conversations, tokenizer_context
from selfspec.core.cli import entry
from selfspec.target.model import TargetConfig, load_tokenizer


@dataclass
class DataStatsConfig:
    target: TargetConfig = field(default_factory=TargetConfig, metadata={"help": (
        "The target whose tokenizer and chat template the data is encoded with (only the tokenizer is loaded).")})
    data: DataConfig = field(default_factory=DataConfig, metadata={"help": "The conversations to count."})


@entry("data_stats", DataStatsConfig)
def main(cfg: DataStatsConfig) -> dict:
    t0 = time.time()
    tokenizer = load_tokenizer(cfg.target)
    stats = data_stats(cfg.data, tokenizer)
    stats["seconds"] = round(time.time() - t0, 1)
    print(format_stats(stats))
    print(json.dumps(stats), flush=True)
    return stats



def data_stats(cfg: DataConfig, tokenizer) -> dict[str, Any]:
    """Tokenize both splits (cached on disk) and count. `conversations` counts usable sequences (train +
    held-out); `records` counts every record read; `skipped` maps each reason to its count."""
    conversations, read = load_conversations(cfg)
    check_max_length(cfg.max_length, tokenizer_context(tokenizer))
    out: dict[str, Any] = {"source": read["source"], "records": read["records"]}
    skipped = Counter(read["skipped"])
    for split in ("train", "heldout"):
        encoded, dropped = tokenize_conversations(select_split(conversations, cfg, split), tokenizer, cfg)
        skipped.update(dropped)
        tokens, loss_tokens, at_max = _count(encoded, cfg.max_length)
        out.update({f"{split}_conversations": len(encoded), f"{split}_tokens": tokens,
                    f"{split}_loss_tokens": loss_tokens, f"{split}_truncated": at_max})
    out["conversations"] = out["train_conversations"] + out["heldout_conversations"]
    out["tokens"] = out["train_tokens"] + out["heldout_tokens"]
    out["loss_tokens"] = out["train_loss_tokens"] + out["heldout_loss_tokens"]
    out["loss_fraction"] = round(out["loss_tokens"] / max(out["tokens"], 1), 4)
    out["mean_tokens"] = round(out["tokens"] / max(out["conversations"], 1), 1)
    out["max_length"] = cfg.max_length
    out["skipped"] = dict(sorted(skipped.items()))
    return out


def format_stats(stats: dict[str, Any]) -> str:
    """A few human-readable lines (the JSON line printed after them is for machines)."""
    skipped = ", ".join(f"{k} {v}" for k, v in stats["skipped"].items()) or "none"
    return "\n".join([
        f"source:        {stats['source']} ({stats['records']} records read)",
        f"conversations: {stats['conversations']} (train {stats['train_conversations']}, "
        f"held-out {stats['heldout_conversations']})",
        f"tokens:        {stats['tokens']} ({stats['mean_tokens']} per conversation; "
        f"{stats['train_truncated'] + stats['heldout_truncated']} cut at max_length {stats['max_length']})",
        f"loss tokens:   {stats['loss_tokens']} ({100 * stats['loss_fraction']:.1f}% of tokens are assistant turns)",
        f"skipped:       {skipped}",
    ])


def _count(encoded, max_length: int) -> tuple[int, int, int]:
    """(tokens, loss tokens, sequences at max_length), summed with Arrow in batches rather than row by row."""
    import pyarrow.compute as pc

    tokens = loss = at_max = 0
    for batch in encoded.with_format("arrow").iter(batch_size=4096):
        lengths = pc.list_value_length(batch["input_ids"])
        tokens += pc.sum(lengths).as_py() or 0
        at_max += pc.sum(pc.greater_equal(lengths, max_length)).as_py() or 0
        loss += pc.sum(pc.list_flatten(batch["loss_mask"])).as_py() or 0
    return int(tokens), int(loss), int(at_max)


if __name__ == "__main__":
    main()
