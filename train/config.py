"""The config every training recipe's schema shares: optimisation, schedule, budget, checkpointing and eval
(`train.*`: TrainConfig), tracking (`logger.*`), and the run's target, data, draft option and folder (RunConfig),
with the checks of its values that need no run (check_precision). Each recipe's own groups (its loss: `eagle.*`,
`ttt.*`, `dflash.*`, `peagle.*`, `layerskip.*`) are dataclasses beside the recipe that extend RunConfig."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

from selfspec.core.errors import UserError
from selfspec.target.model import TargetConfig
from selfspec.data.config import DataConfig

MIXED_PRECISION = ("no", "bf16", "fp16")  # accelerate's fp8 needs Transformer Engine / MS-AMP and a Hopper GPU
RESUME_MODES = ("auto", "exact", "never")  # RunConfig.resume


@dataclass
class TrainConfig:
    """Optimisation, schedule, budget, checkpointing and eval (`train.*`): what every recipe reads. A recipe's
    loss is its own group (`eagle.*`, `ttt.*`, `dflash.*`, `peagle.*`, `layerskip.*`), beside its recipe."""

    lr: float = field(default=3e-4, metadata={"help": "peak AdamW learning rate"})
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95], metadata={"help": "AdamW betas (EAGLE's)"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW decoupled weight decay"})
    warmup_steps: int = field(default=50, metadata={"help": "linear warm-up, in optimizer steps"})
    schedule: str = field(default="cosine", metadata={"help": (
        "after warm-up: constant | linear | cosine (decay to 0 at the last step)")})
    grad_clip_value: float = field(default=0.5, metadata={"help": (
        "clip gradients BY VALUE to +-this (EAGLE); 0 disables")})
    batch_size: int = field(default=1, metadata={"help": "sequences per micro-batch per process"})
    grad_accum: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    epochs: float = field(default=1.0, metadata={"help": (
        "passes over the training set (ignored when max_steps is set)")})
    max_steps: Optional[int] = field(default=None, metadata={"help": "optimizer steps; overrides epochs"})
    max_minutes: Optional[float] = field(default=None, metadata={"help": (
        "wall-clock budget for the loop; stops all processes at one step")})
    seed: int = field(default=0, metadata={"help": "data order, init and any noise a loss draws"})
    lookup_weight: float = field(default=1.0, metadata={"help": (
        "Loss weight of the positions a lookup drafter already drafts right (train/complement.py): < 1 trains a head "
        "for drafter=hybrid, where the lookup covers them (1 = off; DFlash's block loss ignores it).")})
    feature_memo_gb: float = field(default=2.0, metadata={"help": (
        "RAM (GiB) for keeping online target features (bf16) after a sequence's first epoch, so later epochs skip "
        "the target's forward pass (the dominant cost on a CPU); 0 = recompute every epoch in full precision.")})
    mixed_precision: str = field(default="no", metadata={"help": (
        "accelerate: no | bf16 | fp16 (the head's forward/backward under autocast) | auto (bf16 where the device "
        "computes it natively, a GPU or a CPU with AVX-512 BF16/AMX; else no)")})
    features_dtype: str = field(default="float32", metadata={"help": (
        "dtype of the frozen target's forward passes that make training features and soft labels: float32, or "
        "bfloat16 (a bf16 copy of the target; 3x faster here on a CPU with avx512_bf16, and on GPUs; the feature "
        "memo stores bf16 anyway), or auto (bfloat16 where the device computes it natively, else float32: emulated "
        "bf16 is 6x slower than fp32 on an AVX2-only CPU). Held-out eval always runs the target as loaded, like "
        "decoding does.")})
    save_every: int = field(default=200, metadata={"help": (
        "optimizer steps between resumable checkpoints; 0 = only at the end")})
    keep_last: int = field(default=2, metadata={"help": "resumable checkpoints kept"})
    log_every: int = field(default=10, metadata={"help": "optimizer steps between tracker logs"})
    eval_every: int = field(default=200, metadata={"help": (
        "optimizer steps between held-out evals; 0 = only at the end")})
    eval_prompts: int = field(default=8, metadata={"help": (
        "held-out prompts continued greedily by the target for eval; 0 = no eval at all")})
    eval_new_tokens: int = field(default=64, metadata={"help": "greedy tokens per eval prompt"})
    eval_depth: int = field(default=5, metadata={"help": (
        "draft chain length K for the eval of a chain drafter (EAGLE-1/2, EAGLE-3, LayerSkip; tau counts the bonus "
        "token). A DFlash or P-EAGLE head is evaluated at its own block size or depth.")})
    fsdp: bool = field(default=False, metadata={"help": (
        "shard the head's weights, gradients and optimizer state over the processes with torch's FSDP2 "
        "(fully_shard) instead of replicating it with DDP; works on CPUs (gloo, conf/accelerate/cpu_2proc.yaml) and "
        "GPUs. Held-out eval and the export run an unsharded copy of the head (whole state gathered by every "
        "rank). conf/accelerate/gpu_fsdp.yaml shards it through accelerate instead, with the same effect.")})
    shard_target: bool = field(default=False, metadata={"help": (
        "also shard the frozen target's decoder layers with fully_shard (each gathered only around its own "
        "forward: what a 70B target needs); its embedding, final norm and lm_head stay whole. Every rank then "
        "runs the held-out eval in step and the feature memo is off (ranks must call the target together).")})


@dataclass
class LoggerConfig:
    """Experiment tracking through accelerate's trackers (`logger=none|wandb|tensorboard`)."""

    name: str = field(default="none", metadata={"help": "none | wandb | tensorboard"})
    project: str = field(default="selfspec", metadata={"help": "wandb project / tensorboard run folder name"})


@dataclass
class RunConfig:
    """What every recipe's config holds besides its own nodes: the target, the data, the draft option, optimisation,
    tracking, and the run's folder (one output_dir holds one run: train/run.py).
    methods/<recipe>/conf/train_<recipe>.yaml sets output_dir."""

    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    draft: Any = field(default=MISSING, metadata={"help": (
        "methods/<type>/conf/draft/<type>.yaml, typed by its method's schema (methods/: Method.schema)")})
    train: TrainConfig = field(default_factory=TrainConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    output_dir: str = field(default=MISSING, metadata={"help": (
        "Where checkpoints/, the final head/ and ckpt.pt go. Fixed (not time-stamped) so every rank agrees.")})
    resume: str = field(default="auto", metadata={"help": (
        '"auto": continue the run in output_dir if there is one (refused if it is another run: train/run.py), also '
        'on another process count or with a longer schedule (train.max_steps / train.epochs: said, and recorded in '
        'run.json); "exact": continue only an unchanged run; "never": start fresh (refused if output_dir holds a '
        'run, unless overwrite=true).')})
    overwrite: bool = field(default=False, metadata={"help": (
        "true: remove the run already in output_dir (its checkpoints and run.json; said in one line) and start "
        "fresh.")})


def draft_schemas() -> dict[str, dict[str, type]]:
    """Schemas of the `draft/` options (each draft YAML lists `<type>_schema` in its defaults): each method's."""
    from selfspec.registry import method, names

    return {"draft": {f"{name}_schema": method(name).load("schema") for name in names()}}


def check_precision(tc: TrainConfig) -> None:
    """train.mixed_precision and train.features_dtype are ones this device can run (before anything is written);
    `auto` becomes bf16 where the device computes it natively (target.model.native_bf16), else full precision (in
    place, so the run records what it ran). The head's master weights are fp32 whatever the target's dtype; autocast
    runs its forward in the chosen precision, so any target dtype goes with any of these (a bf16 or fp16 target with
    `no` trains the head in fp32)."""
    import torch

    from selfspec.target.model import _dtype, native_bf16

    if "auto" in (tc.mixed_precision, tc.features_dtype):
        bf16 = native_bf16()
        if tc.mixed_precision == "auto":
            tc.mixed_precision = "bf16" if bf16 else "no"
        if tc.features_dtype == "auto":
            tc.features_dtype = "bfloat16" if bf16 else "float32"
    if tc.mixed_precision not in MIXED_PRECISION:
        raise UserError(f"train.mixed_precision={tc.mixed_precision!r}: use one of {', '.join(MIXED_PRECISION)}, auto")
    _dtype(tc.features_dtype, "train.features_dtype")
    if torch.cuda.is_available():
        if "bf16" in (tc.mixed_precision, tc.features_dtype.replace("bfloat16", "bf16")) \
                and not torch.cuda.is_bf16_supported():
            raise UserError(f"this GPU ({torch.cuda.get_device_name()}) has no bfloat16: set "
                            f"train.mixed_precision=fp16 and train.features_dtype=float32 (or float16 targets with "
                            f"target.dtype=float16)")
