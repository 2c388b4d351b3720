"""What every training recipe shares: the optimisation/logging schema, the accelerator, the LR schedule and
the soft labels. Recipes stay readable top to bottom; only these true utilities live here (held-out evaluation
lives in selfspec.eval)."""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from omegaconf import MISSING, OmegaConf

from selfspec.core.errors import SEED_MAX, UserError, check_range
from selfspec.core.target import TargetConfig
from selfspec.data.config import DataConfig

if TYPE_CHECKING:  # eagle_terms' annotations: this module imports torch inside the functions that run it
    import torch


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
    tracking, and the run's folder (one output_dir holds one run: train/run.py). conf/train_<recipe>.yaml sets
    output_dir."""

    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    draft: Any = field(default=MISSING, metadata={"help": (
        "conf/draft/<type>.yaml, typed by its schema (EagleConfig, Eagle3Config, LayerSkipConfig, DFlashConfig or "
        "PEagleConfig)")})
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
    """Schemas of the `draft/` options (each draft YAML lists `<type>_schema` in its defaults)."""
    from selfspec.heads.dflash import DFlashConfig
    from selfspec.heads.eagle import EagleConfig
    from selfspec.heads.eagle3 import Eagle3Config
    from selfspec.heads.layerskip import LayerSkipConfig
    from selfspec.heads.peagle import PEagleConfig

    return {"draft": {"eagle_schema": EagleConfig, "eagle3_schema": Eagle3Config, "layerskip_schema": LayerSkipConfig,
                      "dflash_schema": DFlashConfig, "peagle_schema": PEagleConfig}}


def tracker_config(cfg) -> dict:
    """The composed config as trackers take it: flat dotted keys with scalar values (TensorBoard's hparams refuse
    nested dicts, lists and None; wandb shows dotted keys as nested)."""
    from omegaconf import OmegaConf

    flat = {}

    def walk(node, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            else:
                flat[f"{prefix}{key}"] = value if isinstance(value, (int, float, str, bool)) else str(value)

    walk(OmegaConf.to_container(cfg, resolve=True), "")
    return flat


def run_inputs(cfg) -> list[tuple[str, object]]:
    """What a recipe reads from disk (config key, path): output_dir may not be, hold or lie inside any of them."""
    keys = ("data.path", "data.features_dir", "draft.init_from", "dflash.init_from")
    return [(key, OmegaConf.select(cfg, key, default=None)) for key in keys]


def accelerator_for(tc: TrainConfig, logger: LoggerConfig, output_dir: Path, resume: str = "auto",
                    inputs: list[tuple[str, object]] = ()):
    """Check the run's counts, make the accelerator, and take output_dir's writer lock (hold_output_dir).
    `inputs` (run_inputs): refused as output_dir, inside it or holding it, before anything is written."""
    from accelerate import Accelerator

    if resume not in RESUME_MODES:
        raise UserError(f"resume={resume!r}: use auto (continue the run in output_dir, if any, also on another "
                        f"process count or schedule length), exact (continue only an unchanged run) or never (start "
                        f"fresh; refused if output_dir holds a run, unless overwrite=true)")
    if logger.name not in ("none", "wandb", "tensorboard"):
        raise UserError(f"unknown logger '{logger.name}'; use none, wandb or tensorboard")
    if logger.name != "none" and importlib.util.find_spec(logger.name) is None:  # accelerate would drop it silently
        raise UserError(f"logger={logger.name} needs the `{logger.name}` package: pip install {logger.name}")
    # Counts that must be positive (checked before anything is written: a bad value must not leave a run behind).
    for key, value, low in (("max_steps", tc.max_steps, 1), ("batch_size", tc.batch_size, 1),
                            ("grad_accum", tc.grad_accum, 1), ("save_every", tc.save_every, 0),
                            ("keep_last", tc.keep_last, 0)):
        if value is not None and value < low:
            raise UserError(f"train.{key} must be >= {low}, got {value}")
    if tc.max_steps is None and not tc.epochs > 0:
        raise UserError(f"train.epochs must be > 0 (or set train.max_steps), got {tc.epochs}")
    check_precision(tc)
    check_range("train.lr", tc.lr, 0, low_open=True)  # NaN passes `< 0` tests: every value is checked for range
    check_range("train.seed", tc.seed, 0, SEED_MAX, integer=True)
    if tc.max_minutes is not None:
        check_range("train.max_minutes", tc.max_minutes, 0, low_open=True)
    if logger.name == "wandb" and not os.environ.get("WANDB_API_KEY") and not os.environ.get("WANDB_MODE"):
        os.environ["WANDB_MODE"] = "offline"  # never block on the network: sync later with `wandb sync`
    from selfspec.train.run import check_run_folder

    check_run_folder(output_dir, ("wandb", logger.project), inputs)  # never a folder holding files but no run
    os.environ.setdefault("WANDB_DIR", str(output_dir))
    from selfspec.core.atomic import first_missing

    new = first_missing(output_dir) or False  # what a refused launch removes again (core/atomic.acquire_lock)
    output_dir.mkdir(parents=True, exist_ok=True)
    if not os.access(output_dir, os.W_OK):
        raise UserError(f"output_dir '{output_dir}' is not writable; pass output_dir=<a writable folder>")
    import torch

    if os.environ.get("ACCELERATE_USE_CPU", "").lower() == "true" and os.environ.get("MASTER_ADDR") \
            and "WORLD_SIZE" not in os.environ and "PMI_SIZE" not in os.environ \
            and "OMPI_COMM_WORLD_SIZE" not in os.environ:
        raise UserError("`accelerate launch --cpu --num_processes N` started ONE process (accelerate's CPU launcher "
                        "needs mpirun for more); use `accelerate launch --config_file "
                        "conf/accelerate/cpu_2proc.yaml ...`")
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), gradient_accumulation_steps=tc.grad_accum,
                              mixed_precision=tc.mixed_precision,
                              log_with=None if logger.name == "none" else logger.name, project_dir=str(output_dir))
    hold_output_dir(accelerator, output_dir, new)
    return accelerator


def check_precision(tc: TrainConfig) -> None:
    """train.mixed_precision and train.features_dtype are ones this device can run (before anything is written);
    `auto` becomes bf16 where the device computes it natively (core.target.native_bf16), else full precision (in
    place, so the run records what it ran). The head's master weights are fp32 whatever the target's dtype; autocast
    runs its forward in the chosen precision, so any target dtype goes with any of these (a bf16 or fp16 target with
    `no` trains the head in fp32)."""
    import torch

    from selfspec.core.target import _dtype, native_bf16

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


MIXED_PRECISION = ("no", "bf16", "fp16")  # accelerate's fp8 needs Transformer Engine / MS-AMP and a Hopper GPU
RESUME_MODES = ("auto", "exact", "never")
_held = None  # this process's output_dir lock (selfspec.core.atomic): held until the run ends, the process dies, or the
# process starts its next run (in-process callers: tests, scripts/sweep_exit.py)


def hold_output_dir(accelerator, output_dir: Path, new: bool | Path = False) -> None:
    """Rank 0 takes output_dir's writer lock (selfspec.core.atomic.acquire_lock, an flock the kernel drops when the
    process dies) before anything is written there, and tells every rank whether it got it: a second run on the same
    folder is refused in one line on every rank, so the whole launch exits 2 (no rank hangs at a collective)."""
    global _held
    release_output_dir()
    refusal = None
    if accelerator.is_main_process:
        from selfspec.core.atomic import acquire_lock

        try:
            _held = acquire_lock(output_dir, new=new)
        except UserError as e:
            refusal = str(e)
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        box = [refusal]
        broadcast_object_list(box, from_process=0)
        refusal = box[0]
    if refusal:
        raise UserError(refusal)


def release_output_dir() -> None:
    """Drop this process's output_dir lock (the end of a run; a process's exit drops it anyway)."""
    global _held
    if _held is not None:
        _held.release()
        _held = None


def feature_model(model, dtype: str):
    """The frozen target as the loop runs it for features and soft labels: itself, or a copy in `dtype`."""
    import copy

    from selfspec.core.target import _dtype

    want = _dtype(dtype, "train.features_dtype")
    if next(model.parameters()).dtype == want:
        return model
    return copy.deepcopy(model).to(want)  # frozen and in eval mode like the original


def training_data(data_cfg, target, accelerator, layers=(), offline_hint: str = ""):
    """The training set every recipe reads, and `token_rows()`: its (input_ids, loss_mask) pairs (for draft
    vocabularies). online: token ids + assistant loss mask (rank 0 tokenises first and fills the datasets cache);
    offline: the same plus the target's features and the residual streams `layers` (hidden_states indices),
    precomputed by scripts/cache_features.py; vllm: the same rows as offline, streamed from a vLLM worker.
    `offline_hint` ends the missing-folder message (e.g. its extra_layers)."""
    from selfspec.data.features import OfflineFeatures

    if data_cfg.features == "offline":
        if not data_cfg.features_dir:
            raise UserError(f"data.features=offline needs data.features_dir=<folder from scripts/cache_features.py"
                            f"{offline_hint}>")
        train_set = OfflineFeatures(data_cfg.features_dir, target.identity, layers=layers)
        return train_set, train_set.token_rows
    if data_cfg.features in ("online", "vllm"):
        from selfspec.data.tokenize import build_dataset

        if data_cfg.features == "vllm":
            check_vllm_source(data_cfg, target, accelerator)
        with accelerator.main_process_first():
            train_set = build_dataset(data_cfg, target.tokenizer, "train", context=target.context).with_format(None)
        if data_cfg.features == "vllm":
            streamed = vllm_features(data_cfg, target, train_set, layers)
            return streamed, streamed.token_rows
        return train_set, lambda: ((r["input_ids"], r["loss_mask"]) for r in train_set)
    raise UserError(f"data.features must be online, offline or vllm, not '{data_cfg.features}'")


def check_vllm_source(data_cfg, target, accelerator) -> None:
    """data.features=vllm can run here: one process, a vLLM new enough, a target folder vLLM can load, a final norm."""
    from selfspec.core.target import local_folder
    from selfspec.core.vllm_worker import check_vllm_python

    if accelerator.num_processes > 1:
        raise UserError(f"data.features=vllm streams from one vLLM worker: run one process, not "
                        f"{accelerator.num_processes} (or cache the features once: scripts/cache_features.py "
                        "engine=vllm)")
    check_vllm_python(data_cfg.vllm_python)
    if local_folder(target.identity["name_or_path"]) is None:
        raise UserError(f"data.features=vllm: target '{target.identity['name_or_path']}' has no local HF folder for "
                        "vLLM; use an embedded target or a local model folder")
    if getattr(target.model.get_decoder(), "norm", None) is None:
        raise UserError("data.features=vllm needs the target's final norm (its decoder's `norm`): vLLM returns the "
                        "last layer's state without it")


_feature_workers: list = []  # the vLLM workers streaming this process's features (vllm_features)


def close_feature_workers() -> None:
    """Stop the vLLM workers of data.features=vllm: at the end of a run (train.loop.close), else at exit (a
    worker holds a whole engine's memory: a recipe called twice in one process must not keep the first one's)."""
    while _feature_workers:
        _feature_workers.pop().close()


def vllm_features(data_cfg, target, train_set, layers):
    """`train_set` with its features streamed from a vLLM worker that lives until the run ends."""
    import atexit

    from selfspec.core.target import local_folder
    from selfspec.core.vllm_worker import VllmWorker
    from selfspec.data.features import EngineFeatures, engine_layers

    n = target.identity["num_hidden_layers"]
    longest = max((len(r["input_ids"]) for r in train_set), default=1)
    folder = local_folder(target.identity["name_or_path"])
    print(f"[selfspec] data.features=vllm: starting vLLM on {folder} (layers {engine_layers(layers, n)}) ...",
          flush=True)
    worker = VllmWorker(data_cfg.vllm_python, str(folder), max_model_len=longest + 1,
                        layers=engine_layers(layers, n), dtype=str(target.model.dtype).removeprefix("torch."))
    _feature_workers.append(worker)
    atexit.register(close_feature_workers)
    return EngineFeatures(train_set, worker, layers, n, target.model.get_decoder().norm)


def soft_labels(target_model, hidden, draft_vocab=None, argmax=None):
    """The target's next-token distribution from its post-norm features `hidden` [B, T, H], restricted to the
    draft vocabulary (target ids [V_draft], None = all): (p [B, T, V_draft] fp32, inside [B, T] float, 1 where the
    target's argmax is a draft token: only those positions can ever be accepted, so only they are scored).

    Only the draft vocabulary's rows of the lm_head are computed for p. `inside` needs the argmax over the FULL
    vocabulary: pass it as `argmax` [B, T] when known (the feature memo keeps it), else it is computed here, which
    costs the whole lm_head (on SmolLM2, 6x the draft rows' cost and more than the head's own step)."""
    import torch
    import torch.nn.functional as F
    from torch.profiler import record_function

    from selfspec.core.target import lm_logits

    # torch.profiler ranges (scripts/profile_step.py), nothing without a profiler
    with torch.no_grad(), record_function("soft labels"):
        h = hidden.to(target_model.dtype)
        if draft_vocab is None:
            full = lm_logits(target_model, h).float()  # [B, T, V]
            return F.softmax(full, dim=-1), torch.ones(full.shape[:-1], device=full.device)
        if argmax is None:
            with record_function("target argmax"):
                argmax = lm_logits(target_model, h).argmax(-1)
        vocab = draft_vocab.to(h.device)
        in_vocab = torch.zeros(target_model.get_output_embeddings().weight.shape[0], dtype=torch.bool, device=h.device)
        in_vocab[vocab] = True
        return F.softmax(lm_logits(target_model, h, rows=vocab).float(), dim=-1), in_vocab[argmax].float()


def eagle_terms(logits: torch.Tensor, pred: torch.Tensor, target_feats: torch.Tensor, p: torch.Tensor,
                mask: torch.Tensor, topk: int = 0, w_topk: float = 1.0,
                weight: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, float]:
    """One draft step's EAGLE loss terms, each averaged over `mask` (float [B, T]): SmoothL1 of the predicted
    features against the target's, soft cross-entropy of the draft logits against the target's distribution `p`
    (plus, with `topk`, w_topk x the same sum over the target's top-k tokens only: HASS's harmonized distillation),
    and top-1 agreement with it (a float, for logging). `weight` [B, T] (no gradient) reweights the positions of
    the two losses: their average is then over mask x weight."""
    import torch.nn.functional as F

    logq = F.log_softmax(logits.float(), dim=-1)
    scored = mask if weight is None else mask * weight
    denom = scored.sum().clamp(min=1e-6) if weight is not None else mask.sum().clamp(min=1.0)
    feat = (F.smooth_l1_loss(pred.float(), target_feats, reduction="none").mean(-1) * scored).sum() / denom
    plogq = p * logq
    ce = -plogq.sum(-1)
    if topk:
        ce = ce - w_topk * plogq.gather(-1, p.topk(min(topk, p.shape[-1]), dim=-1).indices).sum(-1)
    tok = (ce * scored).sum() / denom
    acc = (((logq.argmax(-1) == p.argmax(-1)).float() * mask).sum() / mask.sum().clamp(min=1.0)).item()
    return feat, tok, acc


def lr_lambda(warmup: int, total: int, schedule: str):
    if schedule not in ("constant", "linear", "cosine"):
        raise UserError(f"unknown train.schedule '{schedule}'; use constant, linear or cosine")

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        frac = min(1.0, (step - warmup) / max(1, total - warmup))
        if schedule == "linear":
            return 1.0 - frac
        if schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * frac))
        return 1.0

    return factor


def state_digest(state: dict) -> str:
    """A short hash of a state dict: every rank prints it at the end, and they must agree."""
    import hashlib

    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode() + state[k].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def any_rank(accelerator, flag) -> bool:
    """True on every rank if it is true on any (a time budget must stop all processes at the same step)."""
    import torch

    t = torch.tensor([1.0 if flag else 0.0], device=accelerator.device)
    return bool(accelerator.reduce(t, reduction="sum").item() > 0)
