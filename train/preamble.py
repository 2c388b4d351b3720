"""The steps every recipe takes, in the same order, around what is its own (the head it builds, its features and
loss): the accelerator and the frozen target (`open_run`; `accelerator_for` checks the run's settings and takes
output_dir's writer lock first), a head to fine-tune (`head_to_continue`), the draft vocabulary (`top_vocab`,
`vocab_maps`), the run around the built head (`start`: fp32 master weights, optimizer and schedule, the checkpoint
being continued, the held-out set, the trackers) and the feature memo (`feature_memo`). Each recipe calls them top
to bottom: data -> target -> head -> loop."""

from __future__ import annotations

import contextlib
import importlib.util
import os
from pathlib import Path
from typing import Callable, Optional

import torch
from omegaconf import OmegaConf

from selfspec.core.cli import flatten, read_once
from selfspec.core.errors import SEED_MAX, UserError, check_range
from selfspec.target.model import Target, check_identity, load_target_from_config
from selfspec.data.features import FeatureMemo
from selfspec.eval.acceptance import eval_sequences
from selfspec.heads.checkpoint import lineage_seconds, read_head
from selfspec.heads.vocab import top_tokens
from selfspec.train.config import RESUME_MODES, LoggerConfig, TrainConfig, check_precision
from selfspec.train.host import LONG_STEPS, host_line, largest_layer
from selfspec.train.loop import Run, evaluates, restore, start_run
from selfspec.train.run import Resumed, RunRecord, check_run_folder, hold_output_dir


def open_run(cfg):
    """(accelerator, target): the run's settings checked and output_dir's writer lock taken (accelerator_for,
    before anything is written), torch seeded, then the frozen target moved to the device, in eval mode, without
    grads: never wrapped for training."""
    # what the run reads from disk (config key, path): output_dir may not be, hold or lie inside any of them
    inputs = [(key, OmegaConf.select(cfg, key, default=None))
              for key in ("data.path", "data.features_dir", "draft.init_from", "dflash.init_from")]
    accelerator = accelerator_for(cfg.train, cfg.logger, Path(cfg.output_dir), cfg.resume, inputs)
    torch.manual_seed(cfg.train.seed)
    return accelerator, load_target_from_config(cfg.target, device=accelerator.device)


def accelerator_for(tc: TrainConfig, logger: LoggerConfig, output_dir: Path, resume: str = "auto",
                    inputs: list[tuple[str, object]] = ()):
    """Check the run's settings, make the accelerator, and take output_dir's writer lock (train.run.hold_output_dir).
    `inputs` (config key, path: what the run reads): refused as output_dir, inside it or holding it, before anything
    is written."""
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
    check_range("train.lookup_weight", tc.lookup_weight, 0, 1)
    if tc.max_minutes is not None:
        check_range("train.max_minutes", tc.max_minutes, 0, low_open=True)
    if logger.name == "wandb" and not os.environ.get("WANDB_API_KEY") and not os.environ.get("WANDB_MODE"):
        os.environ["WANDB_MODE"] = "offline"  # never block on the network: sync later with `wandb sync`
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


def head_to_continue(spec: Optional[str], key: str, head_type: str | tuple[str, ...],
                     target: Target) -> Optional[tuple[dict, dict]]:
    """The head `key` (draft.init_from, dflash.init_from) names to fine-tune, as read_head reads it (record, state),
    or None when unset: refused in one line unless it is a `head_type` head (one of them) for this target."""
    if not spec:
        return None
    record, state = read_head(spec)
    check_identity(record["target"], target.identity)
    kinds = (head_type,) if isinstance(head_type, str) else head_type
    if record["head"]["type"] not in kinds:
        raise UserError(f"{key} '{spec}' is a '{record['head']['type']}' head, not {' or '.join(kinds)}")
    return record, state


def top_vocab(token_rows: Callable, target: Target, size: int) -> torch.Tensor:
    """A new draft vocabulary: the `size` target ids most frequent among the training set's assistant tokens
    (`token_rows`: training_data's), the end-of-sequence token always among them."""
    eot = [i for i in [target.tokenizer.eos_token_id] if i is not None]
    return top_tokens(token_rows(), target.identity["vocab_size"], size, always=eot)


def draft_vocab(resumed: Optional[Resumed], size: int, target: Target, token_rows: Callable) -> Optional[torch.Tensor]:
    """An EAGLE-1 or LayerSkip head's draft vocabulary: none without draft.vocab_size; the one the checkpoint being
    resumed saved (never rebuilt); else a new one (top_vocab)."""
    if not size:
        return None
    if resumed is not None and "draft_vocab" in resumed.head_state:
        return resumed.head_state["draft_vocab"]
    return top_vocab(token_rows, target, size)


def vocab_maps(kept: Optional[dict], size: int, target: Target, token_rows: Callable, accelerator) -> dict:
    """The vocabulary keyword arguments of an EAGLE-3 or DFlash head: the d2t/t2d of the head being continued
    (`kept`: its state dict, resumed or init_from; none there: the full vocabulary), never rebuilt (a different
    draft.vocab_size is said and ignored); else the top `size` assistant tokens; else {} (the full vocabulary)."""
    if kept is not None:
        maps = {k: kept[k] for k in ("d2t", "t2d") if k in kept}
        n = maps["d2t"].numel() if maps else target.identity["vocab_size"]
        if size and size != n:
            accelerator.print(f"[train] draft.vocab_size={size} ignored: keeping the {n}-token draft vocabulary of "
                              f"the head being continued (never rebuilt)")
        return maps
    if size and size < target.identity["vocab_size"]:
        return {"draft_vocab": top_vocab(token_rows, target, size)}
    return {}


def start(cfg, accelerator, target: Target, head, params: list, sequences: int, record: RunRecord,
          resumed: Optional[Resumed], position: Optional[dict] = None,
          init: Optional[tuple[dict, dict]] = None) -> tuple[Run, list]:
    """(run, held-out sequences) for a built head: its master weights in fp32 (accelerate's autocast runs the
    chosen precision), AdamW over `params` and the LR schedule prepared with it (train.loop.start_run; checkpoints
    save the target's identity and `position`; with `init`, head_to_continue's head, every record the training
    behind it), then the checkpoint being continued, if any (restore); the held-out
    set, prompts continued by the target's own greedy decoding ([] where this rank does not evaluate, or with
    train.eval_prompts=0); last, the trackers started with the composed config."""
    # what the run starts with, read here once: train.* as the TrainConfig the loop reads (check_precision has
    # settled its `auto` values), the data the held-out set comes from, the folder and the trackers' project
    tc = read_once(cfg.train, TrainConfig)
    data, output_dir, project = cfg.data, Path(cfg.output_dir), cfg.logger.project
    head.float().train()
    layer = largest_layer(head)  # before start_run wraps (or shards) it
    # a head that trains weights inside the target's layers (a LoRA exit) has them require grad only while drafting:
    # DDP must see them when it wraps the head
    with getattr(head, "drafting", contextlib.nullcontext)():
        run = start_run(accelerator, head, params, tc, sequences, output_dir,
                        position={"target": target.identity, **(position or {})}, record=record, target=target)
    if init is not None:
        run.init_train_seconds = lineage_seconds(init[0].get("training") or {})
    restore(run, resumed)
    if run.total_steps >= LONG_STEPS and accelerator.is_main_process:  # a long run: what this host computes
        accelerator.print(host_line(layer, accelerator.device, tc.mixed_precision))
    eval_seqs = (eval_sequences(data, target, tc.eval_prompts, tc.eval_new_tokens)
                 if evaluates(run) and tc.eval_prompts else [])
    # trackers take flat dotted keys with scalar values (TensorBoard's hparams refuse nested dicts, lists and None;
    # wandb shows dotted keys as nested)
    flat = flatten(OmegaConf.to_container(cfg, resolve=True))
    accelerator.init_trackers(project, config={k: v if isinstance(v, (int, float, str, bool)) else str(v)
                                               for k, v in flat.items()})
    return run, eval_seqs


def feature_memo(cfg, compute: Callable) -> Optional[FeatureMemo]:
    """RAM for a sequence's online features after its first use (train.feature_memo_gb; `compute`: the recipe's
    features of one sequence), or None: offline and vLLM features are read anyway, and a sharded target's layers
    are collectives every rank must call together."""
    tc = cfg.train
    if tc.feature_memo_gb > 0 and cfg.data.features == "online" and not tc.shard_target:
        return FeatureMemo(tc.feature_memo_gb, compute)
    return None
