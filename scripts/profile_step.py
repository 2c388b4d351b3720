"""Where the compute of one EAGLE training step goes, against this machine's measured matmul peaks.

    python scripts/profile_step.py [experiment=smollm2_eagle_full] [steps=5] [output_file=...]

Builds what methods/eagle/train.py builds (frozen target and its `features_dtype` copy, the training set, the draft
vocabulary, the head, AdamW and its schedule through train/loop.start_run, the feature memo) and runs the recipe's
own train/eagle.micro_step (and the loop's schedule step) under torch.profiler on its first batches (epoch 0, one
process): every lever of the recipe (eagle.topk, ttt.on_policy, ...) reaches the step timed here. The phases (the
torch.profiler ranges the recipe code marks), how their FLOPs are counted and how each phase's peak is measured:
train/step_profile.py. With the memo on, the batches run twice: as in epoch 1 (memo misses) and again as in later epochs
(memo hits); `warmup` steps of each pass are not counted. Figures are medians over the timed steps (the JSON keeps
each step's seconds, GFLOP and loss). Writes the JSON (atomically) to `output_file`: only over a report it wrote
unless overwrite=true (core/ownership.py).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import MISSING
from torch.profiler import record_function

from selfspec.core.cli import entry, owned_output, read_once
from selfspec.core.errors import UserError
from selfspec.core.ownership import Kind, json_keys
from selfspec.target.model import TargetConfig, load_target_from_config
from selfspec.data.config import DataConfig
from selfspec.train.batching import iterate
from selfspec.train.config import TrainConfig, check_precision, draft_schemas
from selfspec.methods.eagle.train import EagleLossConfig, EagleTTTConfig
from selfspec.train.step_profile import measured_report, step_passes, target_alone, torch_threads


@dataclass
class ProfileStepConfig:
    """Schema of conf/profile_step.yaml: the recipe's own groups (as methods/eagle/train.py reads them) plus the
    profile's."""

    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    draft: Any = field(default=MISSING, metadata={
        "help": "methods/eagle/conf/draft/eagle.yaml, as methods/eagle/train.py reads it"})
    train: TrainConfig = field(default_factory=TrainConfig)
    eagle: EagleLossConfig = field(default_factory=EagleLossConfig, metadata={"help": (
        "The EAGLE-1/2 loss, as methods/eagle/train.py reads it.")})
    ttt: EagleTTTConfig = field(default_factory=EagleTTTConfig, metadata={"help": (
        "The training-time test, as methods/eagle/train.py reads it (steps=1: EAGLE-1's teacher-forced loss).")})
    steps: int = field(default=5, metadata={"help": "timed steps per pass (median and spread over them)"})
    warmup: int = field(default=1, metadata={"help": "untimed steps before them, in each pass"})
    peak_repeats: int = field(default=5, metadata={"help": "torch.matmul peak: best of this many timings per shape"})
    threads: Optional[int] = field(default=None, metadata={"help": (
        "torch threads for the step and the peaks (null: torch's default, every core). The shipped recipe's "
        "cpu_2proc launch runs two processes of 1 thread each: threads=1 profiles one of them.")})
    output_file: str = field(default="outputs/profile_step/profile.json", metadata={"help": (
        "The JSON report (its config goes beside it as .config.yaml).")})
    overwrite: bool = field(default=False, metadata={"help": (
        "Replace an existing report or config there that this command did not write (never an input).")})


REPORT = Kind("profile_step report", folder=False, mine=json_keys("formulas", "passes"))  # core/ownership.py


def inputs(cfg) -> list[tuple[str, object]]:
    return [("data.path", cfg.data.path), ("data.features_dir", cfg.data.features_dir)]


@entry("profile_step", ProfileStepConfig, draft_schemas())
def main(cfg) -> dict[str, Any]:
    for name, low in (("steps", 1), ("warmup", 0), ("peak_repeats", 1)):
        if getattr(cfg, name) < low:
            raise UserError(f"{name} must be >= {low} (got {getattr(cfg, name)})")
    if cfg.threads is not None and cfg.threads < 1:
        raise UserError(f"threads must be >= 1 or null (got {cfg.threads})")
    if cfg.draft.type != "eagle":
        raise UserError(f"profile_step profiles methods/eagle/train.py's step (draft=eagle), not "
                        f"draft={cfg.draft.type}")
    if cfg.data.features != "online":
        raise UserError("profile_step profiles online features (data.features=online): the target runs in the step")
    check_precision(cfg.train)  # what the recipe checks (and `auto` resolved as it resolves it)
    out_file = Path(cfg.output_file)
    # the report and its config, each checked before anything is loaded
    with owned_output(cfg, out_file, "output_file", REPORT, inputs(cfg)) as tmp, torch_threads(cfg.threads):
        report = _profile(cfg)
        tmp.write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
    print(f"wrote {out_file}")
    return report


def _profile(cfg) -> dict[str, Any]:
    from accelerate import Accelerator

    from selfspec.data.features import last_features
    from selfspec.methods.eagle.head import build_eagle
    from selfspec.train.features import feature_model, training_data
    from selfspec.methods.eagle.train import micro_step
    from selfspec.train.loop import start_run
    from selfspec.train.preamble import feature_memo, top_vocab

    tc, d, out_file = cfg.train, cfg.draft, Path(cfg.output_file)
    # ---- what methods/eagle/train.py builds (one process; no run folder: nothing is saved)
    acc = Accelerator(cpu=not torch.cuda.is_available(), gradient_accumulation_steps=tc.grad_accum,
                      mixed_precision=tc.mixed_precision)
    torch.manual_seed(tc.seed)
    target = load_target_from_config(cfg.target, device=acc.device)
    tok = target.tokenizer
    teacher = feature_model(target.model, tc.features_dtype)
    train_set, token_rows = training_data(cfg.data, target, acc)
    if len(train_set) < (cfg.warmup + cfg.steps) * tc.batch_size:
        raise UserError(f"{len(train_set)} training sequences: fewer than (warmup + steps) x train.batch_size = "
                        f"{(cfg.warmup + cfg.steps) * tc.batch_size}; lower steps or train.batch_size")
    draft_vocab = top_vocab(token_rows, target, d.vocab_size) if d.vocab_size else None
    head = build_eagle(target.model, num_layers=d.num_layers, fc_bias=d.fc_bias, vocab_size=d.vocab_size,
                       init_from_layer=d.init_from_layer, draft_vocab=draft_vocab, layer=d.layer)
    head.float().train()
    run = start_run(acc, head, [p for p in head.parameters() if p.requires_grad], tc, len(train_set),
                    out_file.parent, position={})
    memo = feature_memo(cfg, last_features(teacher, argmax=draft_vocab is not None))  # online only: checked above

    lc, ttt = read_once(cfg.eagle, EagleLossConfig), read_once(cfg.ttt, EagleTTTConfig)  # read once, as the recipe

    def train_step(batch: dict) -> dict:  # the recipe's micro-step, then what train_loop does after it
        stats = micro_step(run, teacher, memo, batch, lc, ttt)
        if acc.sync_gradients:
            with record_function("optimizer"):
                run.scheduler.step()
        return {"loss": stats["loss"]}

    def batches():  # the first batches of epoch 0, as one process reads them
        return iterate(train_set, tc.batch_size, 0, tc.seed, 0, 1, tok.pad_token_id or 0)

    t0 = time.time()
    passes = step_passes(train_step, batches, cfg.warmup, cfg.steps, acc.device, memo=memo is not None)
    totals = {}
    if teacher is not target.model:  # the memo-miss target work at the target's own dtype
        name = f"target alone at {str(target.model.dtype)[6:]} (features_dtype={tc.features_dtype} above)"
        totals[name] = target_alone(last_features(target.model, argmax=draft_vocab is not None), batches, cfg.warmup,
                                    cfg.steps, acc.device)

    measured = measured_report(passes, totals, cfg.peak_repeats, acc.device)  # peaks on the median batch's shapes
    report = {"target": target.identity["name_or_path"], "device": str(acc.device), "threads": torch.get_num_threads(),
              "batch_size": tc.batch_size, "ttt_steps": cfg.ttt.steps, "ttt_on_policy": cfg.ttt.on_policy,
              "topk": cfg.eagle.topk, "features_dtype": tc.features_dtype, "mixed_precision": tc.mixed_precision,
              "draft_vocab": None if draft_vocab is None else int(draft_vocab.numel()),
              "feature_memo": memo is not None, "steps": cfg.steps, "warmup": cfg.warmup,
              "seconds": round(time.time() - t0, 1), **measured}
    return report


if __name__ == "__main__":
    main()
