"""The loop every training recipe runs: optimizer and LR schedule, resuming, resumable saves, the bookkeeping of
an optimizer step (schedule, data position, logging, eval, saves, the wall-clock budget) and the end of a run.

A recipe keeps what is its own (head, features, loss): it hands `train_loop` a function that runs one
micro-batch and, if it evaluates, one that scores the head on the held-out sequences.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from tqdm.auto import tqdm

from heads.checkpoint import head_record, save_head, save_single_file
from heads.errors import UserError
from train.batching import iterate
from train.common import TrainConfig, any_rank, lr_lambda, state_digest
from train.state import latest_checkpoint, load_head_state, load_state, save_state


@dataclass
class Resumed:
    """The checkpoint a run continues from: its folder and what train.state.load_state read from it."""

    folder: Path
    head_state: dict[str, torch.Tensor]
    trainer: dict  # optimizer, scheduler, torch_rng
    position: dict  # step, epoch, batch, target (+ what the recipe saved)


@dataclass
class Run:
    """What the loop moves on and a resumable checkpoint saves: the prepared head, its optimizer and schedule,
    and the position in the data."""

    accelerator: Any
    head_ddp: Any  # the head as accelerate prepared it (DDP-wrapped with several processes)
    optimizer: Any
    scheduler: Any
    tc: TrainConfig
    output_dir: Path
    position: dict  # saved in every checkpoint after epoch and batch: the target's identity (+ the recipe's)
    batches_per_epoch: int
    total_steps: int  # optimizer steps; cut to the last one taken when the wall-clock budget stops the loop
    step: int = 0
    epoch: int = 0
    batch_idx: int = 0  # the batch of `epoch` to continue from
    tokens_seen: int = 0  # by all processes, this launch
    train_seconds: float = 0.0  # this launch's loop
    metrics: dict = field(default_factory=dict)  # of the last optimizer step

    @property
    def head(self):
        return self.accelerator.unwrap_model(self.head_ddp)


def resume_point(resume: str, output_dir: Path, target_identity: dict, accelerator) -> Optional[Resumed]:
    """resume=auto: the newest checkpoint in output_dir (checked against the target), None if there is none."""
    folder = latest_checkpoint(output_dir) if resume == "auto" else None
    if resume == "auto" and folder is None:
        accelerator.print(f"[train] resume=auto: no checkpoint in {output_dir / 'checkpoints'}; starting fresh")
    return Resumed(folder, *load_state(folder, target_identity)) if folder else None


def start_run(accelerator, head, params: list, tc: TrainConfig, sequences: int, output_dir: Path,
              position: dict) -> Run:
    """AdamW over `params` and its LR schedule (per optimizer step), prepared by accelerate with the head."""
    batches_per_epoch = sequences // (tc.batch_size * accelerator.num_processes)
    if batches_per_epoch == 0:
        raise UserError(f"dataset has {sequences} sequences: fewer than batch_size x processes; lower train.batch_size")
    total_steps = tc.max_steps or math.ceil(tc.epochs * batches_per_epoch / tc.grad_accum)
    optimizer = torch.optim.AdamW(params, lr=tc.lr, betas=tuple(tc.betas), weight_decay=tc.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(tc.warmup_steps, total_steps, tc.schedule))
    head_ddp, optimizer = accelerator.prepare(head, optimizer)
    return Run(accelerator, head_ddp, optimizer, scheduler, tc, output_dir, position, batches_per_epoch, total_steps)


def restore(run: Run, resumed: Optional[Resumed]) -> None:
    """Continue `resumed` (if any): head weights, optimizer, schedule, the torch RNG (exact resume) and position."""
    if resumed is None:
        return
    load_head_state(run.head, resumed.head_state, resumed.folder)
    run.optimizer.load_state_dict(resumed.trainer["optimizer"])
    run.scheduler.load_state_dict(resumed.trainer["scheduler"])
    torch.set_rng_state(resumed.trainer["torch_rng"])
    pos = resumed.position
    run.step, run.epoch, run.batch_idx = pos["step"], pos["epoch"], pos["batch"]
    run.accelerator.print(f"[train] resumed from {resumed.folder} at step {run.step} (epoch {run.epoch}, "
                          f"batch {run.batch_idx})")


def save(run: Run) -> None:
    """Rank 0 writes a resumable checkpoint at the run's position; every rank waits for it."""
    if run.accelerator.is_main_process:
        save_state(run.output_dir, run.step, run.head.state_dict(), run.optimizer.state_dict(),
                   run.scheduler.state_dict(), {"epoch": run.epoch, "batch": run.batch_idx, **run.position},
                   keep=run.tc.keep_last)
    run.accelerator.wait_for_everyone()


def chain_line(ev: dict) -> str:
    """An eval's progress line: chain tau and the per-depth acceptance (train.rollout.chain_acceptance)."""
    return f"tau {ev['tau']:.3f} " + " ".join(f"{k}={v}" for k, v in ev.items() if k.startswith("acc"))


def train_loop(run: Run, train_set, pad_id: int, micro_step: Callable[[dict], dict],
               evaluate: Optional[Callable[[], dict]] = None, eval_line: Callable[[dict], str] = chain_line,
               postfix: Optional[dict[str, str]] = None) -> None:
    """Optimizer steps from the run's position until total_steps or the wall-clock budget (train.max_minutes).

    `micro_step(batch) -> stats` runs one micro-batch already on the device: forward, backward and the
    optimizer's step under accelerate's accumulation. After each optimizer step the schedule steps, stats are
    logged every log_every, rank 0 evaluates every eval_every (`evaluate() -> metrics`, one `eval_line`) and a
    checkpoint is saved every save_every. `postfix`: progress-bar name -> stats key (default loss and acc)."""
    acc, tc = run.accelerator, run.tc
    postfix = postfix or {"loss": "loss", "acc": "acc"}
    bar = tqdm(total=run.total_steps, initial=run.step, disable=not acc.is_main_process, desc="train", dynamic_ncols=True)
    t_start = time.time()
    while run.step < run.total_steps:
        for run.batch_idx, batch in iterate(train_set, tc.batch_size, run.epoch, tc.seed, acc.process_index,
                                            acc.num_processes, pad_id, start=run.batch_idx):
            batch = {k: v.to(acc.device) for k, v in batch.items()}
            stats = micro_step(batch)
            run.tokens_seen += int(batch["attention_mask"].sum()) * acc.num_processes
            if not acc.sync_gradients:
                continue
            run.scheduler.step()
            run.step += 1
            run.batch_idx += 1  # the position to resume from is the next batch
            elapsed = time.time() - t_start
            run.metrics = {**stats, "lr": run.scheduler.get_last_lr()[0], "tokens_per_s": run.tokens_seen / elapsed}
            bar.update(1)
            bar.set_postfix(**{name: f"{stats[key]:.3f}" for name, key in postfix.items()},
                            tps=f"{run.tokens_seen / elapsed:.0f}")
            if run.step % tc.log_every == 0:
                acc.log(run.metrics, step=run.step)
            if tc.eval_every and run.step % tc.eval_every == 0 and evaluate is not None and acc.is_main_process:
                ev = evaluate()
                acc.log({f"eval/{k}": v for k, v in ev.items()}, step=run.step)
                bar.write(f"[eval] step {run.step}: {eval_line(ev)}")
            if tc.save_every and run.step % tc.save_every == 0:
                save(run)
            budget_hit = tc.max_minutes and elapsed > tc.max_minutes * 60
            if run.step >= run.total_steps or any_rank(acc, budget_hit):
                run.total_steps = run.step
                break
        else:
            run.epoch, run.batch_idx = run.epoch + 1, 0
    bar.close()
    run.train_seconds = time.time() - t_start


def finish(run: Run) -> dict:
    """After the loop: every rank prints its head's digest (they must agree), the last resumable checkpoint is
    written, and the run's figures come back (the recipe adds its own)."""
    # one write: with unbuffered stdout print() writes the text and its newline apart, and two ranks' lines can mix
    print(f"[train] rank {run.accelerator.process_index} head sha256 {state_digest(run.head.state_dict())}\n",
          end="", flush=True)
    save(run)
    return {"steps": run.step, "epochs": round(run.epoch + run.batch_idx / max(run.batches_per_epoch, 1), 3),
            "train_seconds": round(run.train_seconds, 1),
            "tokens_per_s": round(run.tokens_seen / max(run.train_seconds, 1e-9), 1), "final_loss": run.metrics.get("loss")}


def export(run: Run, target_identity: dict, training: dict, result: dict) -> None:
    """Rank 0: the head folder and the single-file export, each with its record (`training` + the result)."""
    head, out = run.head, run.output_dir
    record = head_record(head, target_identity,
                         training={**training, "processes": run.accelerator.num_processes, **result},
                         metrics=result.get("heldout", {}))
    save_head(head, out / "head", record)
    save_single_file(head, out / "ckpt.pt", record)
    run.accelerator.print(f"[train] wrote {out / 'head'} and {out / 'ckpt.pt'}")
