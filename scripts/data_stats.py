"""Summarise what a data config yields for a target: conversations, tokens, loss tokens, skipped records.

    python scripts/data_stats.py data=sharegpt target=smollm2-135m [data.max_conversations=1000]

Prints a few readable lines, then one JSON object on the last line.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from selfspec.data.config import DataConfig
from selfspec.data.stats import data_stats, format_stats
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


if __name__ == "__main__":
    main()
