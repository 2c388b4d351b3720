"""The loop every training recipe runs: optimizer and LR schedule, resuming, resumable saves, the bookkeeping of
an optimizer step (schedule, data position, logging, eval, saves, the wall-clock budget, a non-finite loss) and
the end of a run.

A recipe keeps what is its own (head, features, loss): it hands `train_loop` a function that runs one
micro-batch and, if it evaluates, one that scores the head on the held-out sequences.

One output_dir holds one run: train/run.py.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from tqdm.auto import tqdm

from selfspec.core.cli import outputs_complete, read_once
from selfspec.heads.checkpoint import head_record, save_head, save_single_file
from selfspec.heads.vocab import coverage
from selfspec.core.errors import UserError
from selfspec.train.batching import iterate
from selfspec.train.complement import lookup_weighted
from selfspec.core.threads import governor
from selfspec.train.config import TrainConfig
from selfspec.train.host import LONG_STEPS, RATE_STEPS, rate_line
from selfspec.train.features import close_feature_workers
from selfspec.train.run import Resumed, RunRecord, release_output_dir, replace_old_run, same_run, write_record
from selfspec.train.state import (checkpoint_run, list_checkpoints, load_head_state, load_optimizer_state,
                                  save_state)

WARM_STEPS = 5  # a launch's first optimizer steps (CUDA kernels and caches warming up) are left out of steady_step_s


@dataclass
class Run:
    """What the loop moves on and a resumable checkpoint saves: the prepared head, its optimizer and schedule,
    and the position in the data."""

    accelerator: Any
    head_ddp: Any  # the head as accelerate prepared it (DDP-wrapped with several processes) or FSDP sharded it
    optimizer: Any
    scheduler: Any
    tc: TrainConfig  # read once from the composed config (start_run): the loop reads it every step
    output_dir: Path
    position: dict  # saved in every checkpoint after epoch and batch: the target's identity (+ the recipe's)
    batches_per_epoch: int
    total_steps: int  # optimizer steps; cut to the last one taken when the wall-clock budget stops the loop
    step: int = 0
    epoch: int = 0
    batch_idx: int = 0  # the batch of `epoch` to continue from
    record: Optional[RunRecord] = None  # this run's identity (None: unrecorded, as in unit tests)
    tokens_seen: int = 0  # by all processes, this launch
    train_seconds: float = 0.0  # this launch's loop so far
    warm: tuple = ()  # (step, train_seconds) once WARM_STEPS steps of this launch are done: steady_step_s starts there
    seconds_before: float = 0.0  # the loop time of the launches this one continues (from its checkpoint)
    metrics: dict = field(default_factory=dict)  # of the last optimizer step
    whole: Any = None  # under FSDP, on the ranks that evaluate: an unsharded copy of the head for eval and export
    sharding: dict = field(default_factory=dict)  # what was sharded (FSDP), the target's parameter MiB per rank
    planned_steps: Optional[int] = None  # total_steps before the wall-clock budget cut it (None: not cut)
    init_train_seconds: Optional[float] = 0.0  # the lineage of the head fine-tuned from (None: unknown; 0: none)

    @property
    def head(self):
        return self.accelerator.unwrap_model(self.head_ddp)


def start_run(accelerator, head, params: list, tc: TrainConfig, sequences: int, output_dir: Path,
              position: dict, record: Optional[RunRecord] = None, target=None) -> Run:
    """AdamW over `params` and its LR schedule (per optimizer step), prepared by accelerate with the head.

    Under FSDP (train.fsdp, or accelerate's FSDP config) the head is sharded, and `target` (selfspec.target.model's
    Target) is needed: the ranks that evaluate keep an unsharded copy of the head for eval and export (built here,
    before anything is sharded), and train.shard_target shards its decoder layers. `tc` (the composed `train.*` or a
    TrainConfig) is read once, here: the Run keeps it as a TrainConfig, which the loop reads every step."""
    tc = read_once(tc, TrainConfig)
    batches_per_epoch = sequences // (tc.batch_size * accelerator.num_processes)
    if batches_per_epoch == 0:
        raise UserError(f"dataset has {sequences} sequences: fewer than batch_size x processes; lower train.batch_size")
    total_steps = tc.max_steps or math.ceil(tc.epochs * batches_per_epoch / tc.grad_accum)
    by_accelerate = str(accelerator.distributed_type).endswith("FSDP")  # conf/accelerate/gpu_fsdp.yaml
    fsdp = tc.fsdp or by_accelerate
    if fsdp:
        check_shardable(head, target)
    if (tc.fsdp or tc.shard_target) and not torch.distributed.is_initialized():
        raise UserError("train.fsdp and train.shard_target shard over the processes of a launch: start it with "
                        "`accelerate launch --config_file conf/accelerate/cpu_2proc.yaml ...` (or a GPU config)")
    evaluates_here = accelerator.is_main_process or tc.shard_target
    whole = unsharded_copy(head, target).to(accelerator.device) if fsdp and evaluates_here else None
    sharding = shard_target(accelerator, target, tc) if tc.shard_target else {}
    if tc.fsdp and not by_accelerate:  # shard it here (accelerate runs FSDP only on GPUs): the optimizer must
        # then be built over the sharded parameters, found again by name. One FSDP unit, the whole head: the heads'
        # forwards call their layers' submodules directly, so a layer cannot be a unit of its own.
        from torch.distributed.fsdp import fully_shard

        names = {id(p): n for n, p in head.named_parameters()}
        trained = {names[id(p)] for p in params}
        fully_shard(head, mesh=mesh(accelerator))
        params = [p for n, p in head.named_parameters() if n in trained]
    optimizer = torch.optim.AdamW(params, lr=tc.lr, betas=tuple(tc.betas), weight_decay=tc.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(tc.warmup_steps, total_steps, tc.schedule))
    if tc.fsdp and not by_accelerate:
        head_ddp, optimizer = head, accelerator.prepare(optimizer)
    else:
        head_ddp, optimizer = accelerator.prepare(head, optimizer)
    if sharded(head_ddp):
        from torch.distributed.fsdp import register_fsdp_forward_method

        # FSDP gathers a module's weights only around its forward: the head's other methods that training calls
        # and that read its own weights (EAGLE-3's logits, DFlash's context and logits) are made forwards too
        for name in getattr(head, "forward_methods", ()):
            register_fsdp_forward_method(head_ddp, name)
        sharding["sharded"] = ["head", *sharding.get("sharded", [])]
    return Run(accelerator, head_ddp, optimizer, scheduler, tc, output_dir, position, batches_per_epoch, total_steps,
               record=record, whole=whole, sharding=sharding)


def lr_lambda(warmup: int, total: int, schedule: str):
    """The LR factor at an optimizer step: linear warm-up over `warmup` steps, then `schedule` to `total`."""
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


def check_shardable(head, target) -> None:
    """A head FSDP can shard owns the weights it trains: a layerskip LoRA exit trains weights inside the target's own
    layers (run by the target's forward, not the head's), which FSDP cannot gather for it. One line, before
    anything is written."""
    if target is None:
        raise UserError("train.fsdp needs the target passed to start_run (a recipe bug)")
    theirs = {id(p) for p in target.model.parameters()}
    shared = [n for n, p in head.named_parameters() if p.requires_grad and id(p) in theirs]
    if shared:
        raise UserError(f"this {head.head_type} head cannot be sharded with FSDP: it trains weights inside the "
                        f"target's layers ({shared[0]}, ...); use DDP (drop train.fsdp, or use another accelerate "
                        f"config) or an exit with its own weights (draft.adapter=light or layer)")
    if not any(p.requires_grad for p in head.parameters()):
        raise UserError(f"this {head.head_type} head has no trainable parameters: FSDP has nothing to shard")


def unsharded_copy(head, target):
    """A fresh unsharded head of the same config, built for `target` the way a checkpoint is read
    (heads.checkpoint.build_head) and kept in fp32 like the trained one; eval_head loads the whole state into it.
    Built outside the seeded RNG stream: a FSDP run draws the same random numbers as a DDP one."""
    from selfspec.heads.checkpoint import build_head

    with torch.random.fork_rng(devices=[]):  # built on the CPU from a CPU state; the caller puts it on the device
        state = {k: v.detach().cpu() for k, v in head.state_dict().items()}
        copy = build_head(head.head_config(), state, target, "the head being trained")
    return copy.float()


def mesh(accelerator):
    """All the processes, one FSDP shard each."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(accelerator.device.type, (accelerator.num_processes,))


def shard_target(accelerator, target, tc: TrainConfig) -> dict:
    """train.shard_target: every decoder layer of the frozen target becomes a FSDP2 unit of its own, gathered
    around its forward and freed after it (no gradients: it is frozen). The embedding, final norm and lm_head stay
    whole (the heads read them directly). -> the parameter MiB per rank, before and after (also printed)."""
    from torch.distributed.fsdp import fully_shard

    from selfspec.target.model import _dtype

    if _dtype(tc.features_dtype, "train.features_dtype") != target.model.dtype:
        raise UserError(f"train.shard_target with train.features_dtype={tc.features_dtype} would keep a whole second "
                        f"copy of the target for features: load the target in that dtype (target.dtype=...) instead")
    before, every = param_bytes(target.model), mesh(accelerator)
    for layer in target.model.get_decoder().layers:  # each layer is its own FSDP root: freed after its forward
        fully_shard(layer, mesh=every, reshard_after_forward=True)
    after = param_bytes(target.model)
    accelerator.print(f"[train] target sharded over {accelerator.num_processes} processes: parameters "
                      f"{before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB per process")
    return {"sharded": ["target"], "target_param_mib_whole": round(before / 2**20, 2),
            "target_param_mib_per_rank": round(after / 2**20, 2)}


def param_bytes(model) -> int:
    """The bytes of `model`'s parameters held by this process (a FSDP shard counts its local part)."""
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size() for p in model.parameters())


def evaluates(run: Run) -> bool:
    """Whether this rank runs the held-out eval: rank 0, or every rank when the target is sharded (its layers are
    then collectives that all ranks must call together)."""
    return run.accelerator.is_main_process or run.tc.shard_target


def eval_head(run: Run):
    """The head to evaluate and export: the trained head itself, or under FSDP the unsharded copy loaded with the
    whole state (gathered by every rank: call it on every rank), None on the ranks that do not evaluate."""
    if not sharded(run.head_ddp):
        return run.head
    state = whole_head_state(run)
    if run.whole is not None:
        run.whole.load_state_dict(state)
    return run.whole


def restore(run: Run, resumed: Optional[Resumed]) -> None:
    """Continue `resumed` (if any): head weights, optimizer, schedule, GradScaler, this process's RNG states (exact
    resume) and position. A checkpoint past this run's last step is refused: nothing would train, and another
    run's head would be exported under this run's record."""
    if resumed is None:
        return
    pos, acc = resumed.position, run.accelerator
    if pos["step"] > run.total_steps:
        raise UserError(f"checkpoint {resumed.folder} is at step {pos['step']}, past this run's last step "
                        f"({run.total_steps}): it is not this run's; pass overwrite=true to replace it, or another "
                        f"output_dir")
    load_trained_state(run, resumed)
    run.scheduler.load_state_dict(resumed.trainer["scheduler"])
    if acc.scaler is not None and "scaler" in resumed.trainer:
        acc.scaler.load_state_dict(resumed.trainer["scaler"])
    rng, k = resumed.trainer.get("rng", {}), acc.process_index
    torch.set_rng_state(rng.get(f"cpu_{k}", resumed.trainer["torch_rng"]))  # older checkpoints: rank 0's
    if f"cuda_{k}" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng[f"cuda_{k}"])
    run.step, run.epoch, run.batch_idx = pos["step"], pos["epoch"], pos["batch"]
    was = (pos.get("run") or {}).get("processes", acc.num_processes)
    if was != acc.num_processes:  # elastic: the same share of the epoch, in this launch's per-process batches
        run.batch_idx = pos["batch"] * was // acc.num_processes
    run.seconds_before = pos.get("train_seconds", 0.0)  # older checkpoints did not record it
    done = " (the run is complete: nothing to train; its head is written again)" if run.step == run.total_steps else ""
    acc.print(f"[train] resumed from {resumed.folder} at step {run.step} (epoch {run.epoch}, batch "
              f"{run.batch_idx}){done}")


def optimizer_step(run: Run) -> None:
    """A micro-batch's step after its backward: once the gradients are whole (the last micro-batch of an
    accumulation) they are clipped BY VALUE to +-train.grad_clip_value (EAGLE's; 0 = never), then AdamW steps
    (accelerate skips it inside an accumulation) and the gradients are dropped. Clipping by value is elementwise, so
    under FSDP each rank clamps its own shard of the gradient, the same as clamping it whole: accelerate's
    clip_grad_value_ refuses FSDP (it knows only norm clipping, which needs every shard), so this is its body."""
    acc, tc = run.accelerator, run.tc
    if acc.sync_gradients and tc.grad_clip_value:
        acc.unscale_gradients()  # a no-op without fp16's grad scaler
        torch.nn.utils.clip_grad_value_(run.head_ddp.parameters(), tc.grad_clip_value)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)



def memo_step(run: Run, memo: Optional[Callable[[dict], dict]],
              loss: Callable[[dict], tuple[torch.Tensor, dict]]) -> Callable[[dict], dict]:
    """The micro-step of a recipe whose target features come from a memo once a sequence has been seen (EAGLE-3,
    P-EAGLE, DFlash): the memo's features into the batch, `loss(batch)` -> (loss, stats) under accumulation and
    autocast, backward, the optimizer's step; returns the stats."""
    acc = run.accelerator

    def micro_step(batch: dict) -> dict:
        if memo is not None:
            batch.update(memo(batch))
        with acc.accumulate(run.head_ddp), acc.autocast():
            value, stats = loss(batch)
            acc.backward(value)
            optimizer_step(run)
        return stats

    return micro_step

def sharded(model) -> bool:
    """FSDP (1 or 2) shards the head's parameters: its state is only whole when every rank gathers it."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return isinstance(model, (FSDPModule, FullyShardedDataParallel))


def gather_trained_state(accelerator, model, optimizer) -> tuple[dict, dict]:
    """(head state, optimizer state), whole on rank 0 (under FSDP the other ranks get empty dicts). Every rank
    must call it: under FSDP it is a collective. Plain and DDP heads are replicas: rank 0's own state is whole."""
    if not sharded(model):
        return accelerator.get_state_dict(model), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    whole = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered to rank 0's CPU
    return (get_model_state_dict(model, options=whole),
            get_optimizer_state_dict(model, getattr(optimizer, "optimizer", optimizer), options=whole))


def load_trained_state(run: Run, resumed: Resumed) -> None:
    """Put a checkpoint's whole head and optimizer state into the prepared run (every rank read it from disk;
    under FSDP each keeps its own shard)."""
    head_state, optimizer_state = resumed.head_state, resumed.trainer["optimizer"]
    if not sharded(run.head_ddp):
        load_head_state(run.head, head_state, resumed.folder)
        load_optimizer_state(run.optimizer, optimizer_state, resumed.folder)
        return
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    if any(not isinstance(k, str) for k in optimizer_state.get("state", {})):
        raise UserError(f"checkpoint {resumed.folder} was written without FSDP; resume it with the launch config "
                        f"that wrote it, or pass overwrite=true")
    whole = StateDictOptions(full_state_dict=True)
    set_model_state_dict(run.head_ddp, head_state, options=whole)
    set_optimizer_state_dict(run.head_ddp, getattr(run.optimizer, "optimizer", run.optimizer), optimizer_state,
                             options=whole)


def last_checkpoint(run: Run) -> Optional[Path]:
    """This run's newest checkpoint (its earlier launches' included; not another run's that overwrite=true has not
    replaced yet)."""
    mine = same_run(run.record.identity if run.record is not None else None)
    ours = [p for p in list_checkpoints(run.output_dir) if mine(checkpoint_run(p))]
    return ours[-1] if ours else None


def rng_states(accelerator) -> dict[str, torch.Tensor]:
    """Every process's RNG states, `cpu_<rank>` and (with CUDA) `cuda_<rank>`: a collective."""
    mine = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        mine["cuda"] = torch.cuda.get_rng_state()
    every = [mine]
    if accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        every = gather_object([mine])  # in rank order
    return {f"{kind}_{rank}": state for rank, states in enumerate(every) for kind, state in states.items()}


def save(run: Run) -> None:
    """Every rank gathers its part (FSDP shards, its RNG states); rank 0 writes a resumable checkpoint at the
    run's position; every rank waits for it."""
    acc = run.accelerator
    head_state, optimizer_state = gather_trained_state(acc, run.head_ddp, run.optimizer)
    rng = rng_states(acc)
    # a finite loss can still step the weights to inf: such a state is never written (nor exported after it)
    broken = acc.is_main_process and any(v.is_floating_point() and not bool(torch.isfinite(v).all())
                                         for v in head_state.values())
    if any_rank(acc, broken):
        raise UserError(f"non-finite head weights at step {run.step}; the last good checkpoint is "
                        f"{last_checkpoint(run) or 'none (none was saved yet)'}; lower train.lr or fix "
                        f"the data and start again with overwrite=true or another output_dir")
    if acc.is_main_process:
        first = run.record is not None and not run.record.written
        if first:
            replace_old_run(run.output_dir, run.record)
        identity = run.record.identity if run.record is not None else None
        seconds = round(run.seconds_before + run.train_seconds, 3)  # ms: a tiny run's steps are fast
        record = (head_record(run.head, run.position["target"], training={"steps": run.step, "train_seconds": seconds,
                                                                          "checkpoint": True, **lineage(run)})
                  if "target" in run.position else None)
        save_state(run.output_dir, run.step, head_state, optimizer_state, run.scheduler.state_dict(),
                   {"epoch": run.epoch, "batch": run.batch_idx, **run.position, "run": identity,
                    "train_seconds": seconds},
                   keep=run.tc.keep_last, rng=rng, scaler_state=None if acc.scaler is None else acc.scaler.state_dict(),
                   head_config=record, same_run=same_run(identity))
        if first:
            write_record(run.output_dir, run.record)
    acc.wait_for_everyone()


def lineage(run: Run) -> dict:
    """The training before this run's, for a record (heads.checkpoint.lineage_seconds): none for a head trained
    from scratch."""
    return {} if run.init_train_seconds == 0 else {"init_train_seconds": run.init_train_seconds}


def chain_line(ev: dict) -> str:
    """An eval's progress line: chain tau and the per-depth acceptance (selfspec.eval.acceptance.chain_acceptance)."""
    return f"tau {ev['tau']:.3f} " + " ".join(f"{k}={v}" for k, v in ev.items() if k.startswith("acc"))


def train_loop(run: Run, train_set, pad_id: int, micro_step: Callable[[dict], dict],
               evaluate: Optional[Callable[[], dict]] = None, eval_line: Callable[[dict], str] = chain_line,
               postfix: Optional[dict[str, str]] = None) -> None:
    """Optimizer steps from the run's position until total_steps or the wall-clock budget (train.max_minutes).

    `micro_step(batch) -> stats` runs one micro-batch already on the device: forward, backward and the
    optimizer's step under accelerate's accumulation. After each optimizer step the schedule steps, stats are
    logged every log_every, rank 0 (every rank with a sharded target) evaluates every eval_every
    (`evaluate(eval_head(run)) -> metrics`, one `eval_line`) and a checkpoint is saved every save_every.
    `postfix`: progress-bar name -> stats key (default loss and acc)."""
    acc, tc = run.accelerator, run.tc
    postfix = postfix or {"loss": "loss", "acc": "acc"}
    bar = tqdm(total=run.total_steps, initial=run.step, disable=not acc.is_main_process, desc="train",
               dynamic_ncols=True)
    t_start, first_step = time.time(), run.step
    bad_loss = None  # the first non-finite loss of this optimizer step's micro-batches, on this rank
    with governor() as threads:
        while run.step < run.total_steps:
            for run.batch_idx, batch in iterate(train_set, tc.batch_size, run.epoch, tc.seed, acc.process_index,
                                                acc.num_processes, pad_id, start=run.batch_idx):
                if tc.lookup_weight != 1.0:  # a head for drafter=hybrid: the lookup's hits weigh less
                    batch = lookup_weighted(batch, tc.lookup_weight)  # (train/complement.py)
                batch = {k: v.to(acc.device) for k, v in batch.items()}
                threads.tick()  # torch's threads sized to the cores other jobs leave free (core/threads.py)
                stats = micro_step(batch)
                run.tokens_seen += int(batch["attention_mask"].sum()) * acc.num_processes
                if bad_loss is None and not math.isfinite(stats["loss"]):
                    bad_loss = stats["loss"]
                if not acc.sync_gradients:
                    continue
                # A non-finite loss has already reached the weights through this step: stop before they are logged,
                # evaluated or saved (every rank at once); the last checkpoint on disk is the last good state.
                if any_rank(acc, bad_loss is not None):
                    bar.close()
                    last = last_checkpoint(run)
                    value = bad_loss if bad_loss is not None else "on another process"
                    raise UserError(f"non-finite loss ({value}) at step {run.step + 1}; the last good checkpoint is "
                                    f"{last or 'none (none was saved yet)'}; lower train.lr or fix the data and start "
                                    f"again with overwrite=true or another output_dir")
                run.scheduler.step()
                run.step += 1
                run.batch_idx += 1  # the position to resume from is the next batch
                elapsed = run.train_seconds = time.time() - t_start
                if run.step - first_step == WARM_STEPS:
                    run.warm = (run.step, elapsed)
                if run.step - first_step == RATE_STEPS and run.total_steps >= LONG_STEPS and acc.is_main_process:
                    line = rate_line(run.tokens_seen / elapsed, RATE_STEPS)  # train/host.py
                    if line:
                        bar.write(line)
                run.metrics = {**stats, "lr": run.scheduler.get_last_lr()[0], "tokens_per_s": run.tokens_seen / elapsed}
                bar.update(1)
                bar.set_postfix(**{name: f"{stats[key]:.3f}" for name, key in postfix.items()},
                                tps=f"{run.tokens_seen / elapsed:.0f}")
                if run.step % tc.log_every == 0:
                    acc.log(run.metrics, step=run.step)
                if tc.eval_every and run.step % tc.eval_every == 0 and evaluate is not None:
                    head = eval_head(run)  # under FSDP a collective: every rank gathers the whole head
                    if evaluates(run):
                        ev = evaluate(head)
                        acc.log({f"eval/{k}": v for k, v in ev.items()}, step=run.step)
                        if acc.is_main_process:
                            bar.write(f"[eval] step {run.step}: {eval_line(ev)}")
                if tc.save_every and run.step % tc.save_every == 0:
                    save(run)
                budget_hit = tc.max_minutes and elapsed > tc.max_minutes * 60
                if run.step >= run.total_steps or any_rank(acc, budget_hit):
                    if run.step < run.total_steps:
                        run.planned_steps = run.total_steps
                        bar.write(f"[train] train.max_minutes={tc.max_minutes} reached: stopped at step {run.step} of "
                                  f"{run.total_steps} (the schedule was not finished)")
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
    print(f"[train] rank {run.accelerator.process_index} head sha256 {state_digest(whole_head_state(run))}\n",
          end="", flush=True)
    save(run)
    return {"steps": run.step, "epochs": round(run.epoch + run.batch_idx / max(run.batches_per_epoch, 1), 3),
            "train_seconds": round(run.train_seconds, 3),  # ms, like the checkpoints: a tiny run's launch is fast
            "total_train_seconds": round(run.seconds_before + run.train_seconds, 3),  # resumed launches included
            **lineage(run),
            "tokens_per_s": round(run.tokens_seen / max(run.train_seconds, 1e-9), 1),
            "final_loss": run.metrics.get("loss"),
            **steady_step(run),
            **({"stopped_by": "train.max_minutes", "planned_steps": run.planned_steps} if run.planned_steps else {}),
            "distributed_type": str(run.accelerator.distributed_type).rsplit(".", 1)[-1],
            **peak_memory(run.accelerator),
            **run.sharding}


def steady_step(run: Run) -> dict:
    """{"steady_step_s": seconds per optimizer step after this launch's first WARM_STEPS} (evals and saves included:
    a probe that times steps turns them off), or {} when the launch took no step past them."""
    if not run.warm or run.step <= run.warm[0]:
        return {}
    return {"steady_step_s": round((run.train_seconds - run.warm[1]) / (run.step - run.warm[0]), 4)}


def peak_memory(accelerator) -> dict:
    """This process's peak accelerator memory (MiB, torch's allocator) where there is one; {} on a CPU."""
    if accelerator.device.type != "cuda":
        return {}
    return {"peak_gpu_mib": round(torch.cuda.max_memory_allocated(accelerator.device) / 2**20, 1)}


def whole_head_state(run: Run) -> dict:
    """The head's whole state on every rank (under FSDP gathered by all of them: a collective)."""
    if not sharded(run.head_ddp):
        return run.head.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(run.head_ddp, options=StateDictOptions(full_state_dict=True))


def close(run: Run) -> None:
    """The end of a run: trackers are closed, a vLLM feature worker is stopped and output_dir's writer lock is
    released."""
    run.accelerator.end_training()
    close_feature_workers()
    release_output_dir()


def conclude(run: Run, evaluate: Optional[Callable], heldout_line: Callable[[dict], str], token_rows: Callable,
             target_identity: dict, training: dict, extra: Optional[dict] = None) -> dict:
    """The end of every recipe, after train_loop: finish(run) (the last checkpoint; the run's figures plus the
    recipe's `extra`), the held-out eval of the whole head (`evaluate`, None when there are no held-out sequences;
    `heldout_line` words its figures), then on rank 0 the draft vocabulary's coverage of 500 training rows and the
    head folder + single-file export with their record (`training` + the result); the run is closed."""
    result = {**finish(run), **(extra or {})}
    trained = eval_head(run)  # under FSDP a collective: the whole head, unsharded, on the ranks that evaluate
    if evaluate is not None:
        result["heldout"] = evaluate(trained)
        run.accelerator.print(f"[train] held-out {heldout_line(result['heldout'])}")
    if run.accelerator.is_main_process:
        trained.eval()
        draft_vocab = trained.draft_token_ids()
        if draft_vocab is not None:
            rows = itertools.islice(token_rows(), 500)
            result["draft_vocab_coverage"] = round(coverage(draft_vocab.cpu(), rows), 4)
        export(run, trained, target_identity, training, result)
    close(run)
    return result


def export(run: Run, head, target_identity: dict, training: dict, result: dict) -> None:
    """Rank 0: the head folder and the single-file export of `head` (eval_head(run)), each with its record
    (`training` + the result)."""
    out = run.output_dir
    record = head_record(head, target_identity,
                         training={**training, "processes": run.accelerator.num_processes, **result},
                         metrics=result.get("heldout", {}))
    save_head(head, out / "head", record)
    save_single_file(head, out / "ckpt.pt", record)
    outputs_complete(f"{out / 'head'}, {out / 'ckpt.pt'}")  # a Ctrl-C from here on says so (core/cli.py)
    run.accelerator.print(f"[train] wrote {out / 'head'} and {out / 'ckpt.pt'}")


def state_digest(state: dict) -> str:
    """A short hash of a state dict: every rank prints it at the end, and they must agree."""
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode() + state[k].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def any_rank(accelerator, flag) -> bool:
    """True on every rank if it is true on any (a time budget must stop all processes at the same step)."""
    t = torch.tensor([1.0 if flag else 0.0], device=accelerator.device)
    return bool(accelerator.reduce(t, reduction="sum").item() > 0)
