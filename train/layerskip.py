"""Train a LayerSkip early-exit adapter on a frozen target: `accelerate launch train/layerskip.py [overrides]`.

Reads top to bottom: config -> accelerator -> frozen target -> data -> head -> optimizer -> loop -> save.
Distillation from the target itself, at every position t (no shift: the exit at t and the final layer at t both
predict token t+1):
    loss = w_tok * softCE(p_L(. | x_<=t), q_E(. | x_<=t)) + w_feat * SmoothL1(norm(exit_t), f_L,t)
p_L: the target's final-layer distribution (temperature-free), restricted to the draft vocabulary; q_E: the
exit's. softCE = KL(p_L || q_E) + H(p_L), the same gradients as the KL. Positions whose next token is not an
assistant token, or whose target argmax the draft vocabulary cannot express, are masked out. The feature term
(default weight 0) regresses the exit's post-norm state onto the target's final post-norm features.

Teacher inputs: online, one no-grad target pass (hidden_states[E] and the last hidden state); offline, the
features folder of scripts/cache_features.py with extra_layers=[E]. adapter=lora runs layers 0..E-1 itself with
its LoRA on (and gradients), the teacher pass with it off.

Held-out eval (`exit_acceptance`): on the target's own greedy continuations, a layerskip chain started at
position i drafts x_{i+1}, then runs layers 0..E-1 over its own draft... which, while every draft so far matched,
IS the greedy path. So one exit pass over the continuation gives every chain's acceptance: depth d is accepted
iff the exit's argmax matches the target's at positions i..i+d-1.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import MISSING, OmegaConf
from tqdm.auto import tqdm

from data.config import DataConfig
from heads.checkpoint import head_record, save_head, save_single_file
from heads.cli import entry
from heads.errors import UserError
from heads.layerskip import build_layerskip
from heads.target import TargetConfig, load_target_from_config
from heads.vocab import coverage, top_tokens
from train.batching import iterate
from train.common import (LoggerConfig, TrainConfig, accelerator_for, any_rank, draft_schemas, eval_sequences,
                          feature_model, lr_lambda, soft_labels, state_digest)
from train.features import OfflineFeatures
from train.state import latest_checkpoint, load_head_state, load_state, save_state


@dataclass
class TrainLayerSkipConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    draft: Any = MISSING  # conf/draft/layerskip.yaml, typed by LayerSkipConfig
    train: TrainConfig = field(default_factory=TrainConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    # Where checkpoints/, the final head/ and ckpt.pt go. Fixed (not time-stamped) so every rank agrees.
    output_dir: str = "outputs/layerskip"
    # "auto": continue from the newest checkpoint in output_dir if any; "never": start fresh.
    resume: str = "auto"


@entry("train_layerskip", TrainLayerSkipConfig, draft_schemas())
def main(cfg) -> dict:
    d = cfg.draft
    if d.type != "layerskip":
        raise UserError(f"train/layerskip.py trains draft=layerskip heads, not '{d.type}'")
    out = Path(cfg.output_dir)
    tc = cfg.train
    accelerator = accelerator_for(tc, cfg.logger, out)
    torch.manual_seed(tc.seed)

    # ---- frozen target (moved to the device, eval mode, no grads: never wrapped for training)
    target = load_target_from_config(cfg.target, device=accelerator.device)
    tok = target.tokenizer
    teacher = feature_model(target.model, tc.features_dtype)  # the target (or its bf16 copy) making features
    E, n_layers = int(d.exit_layer), target.identity["num_hidden_layers"]
    if not 1 <= E < n_layers:
        raise UserError(f"draft.exit_layer={E}: train an exit in 1..{n_layers - 1} (exit_layer={n_layers} is the "
                        f"target itself)")

    # ---- data: token ids + assistant loss mask; offline: plus the target's final features and layer E
    if cfg.data.features == "offline":
        if not cfg.data.features_dir:
            raise UserError("data.features=offline needs data.features_dir=<folder from scripts/cache_features.py "
                            f"extra_layers=[{E}]>")
        train_set = OfflineFeatures(cfg.data.features_dir, target.identity, layers=[E])
        token_rows = train_set.token_rows
    elif cfg.data.features == "online":
        from data.tokenize import build_dataset

        with accelerator.main_process_first():
            train_set = build_dataset(cfg.data, tok, "train").with_format(None)
        token_rows = lambda: ((r["input_ids"], r["loss_mask"]) for r in train_set)  # noqa: E731
    else:
        raise UserError(f"data.features must be online or offline, not '{cfg.data.features}'")

    # ---- resume point: it must be the same exit (layer, adapter); its draft vocabulary is reused as saved
    ckpt = latest_checkpoint(out) if cfg.resume == "auto" else None
    resumed = load_state(ckpt, target.identity) if ckpt else None
    if cfg.resume == "auto" and ckpt is None:
        accelerator.print(f"[train] resume=auto: no checkpoint in {out / 'checkpoints'}; starting fresh")

    # ---- head: the exit at layer E, reduced vocabulary if asked
    draft_vocab = None
    if d.vocab_size:
        if resumed is not None and "draft_vocab" in resumed[0]:
            draft_vocab = resumed[0]["draft_vocab"]
        else:
            eot = [i for i in [tok.eos_token_id] if i is not None]
            draft_vocab = top_tokens(token_rows(), target.identity["vocab_size"], d.vocab_size, always=eot)
    head = build_layerskip(target.model, exit_layer=E, adapter=d.adapter, rank=d.rank,
                           init_from_target=d.init_from_target, lora_rank=d.lora_rank, lora_alpha=d.lora_alpha,
                           lora_targets=list(d.lora_targets), vocab_size=d.vocab_size, draft_vocab=draft_vocab)
    if resumed is not None:
        was = resumed[2].get("head")
        if was is not None and was != head.head_config():
            raise UserError(f"{ckpt} holds a different exit ({_describe(was)}) than draft= asks "
                            f"({_describe(head.head_config())}); use another output_dir or resume=never")
    head.float().train()  # master weights in fp32; accelerate's autocast handles mixed precision
    params = head.trainable_parameters()
    n_params = sum(p.numel() for p in params)

    # ---- optimizer and schedule (per optimizer step)
    batches_per_epoch = len(train_set) // (tc.batch_size * accelerator.num_processes)
    if batches_per_epoch == 0:
        raise UserError(f"dataset has {len(train_set)} sequences: fewer than batch_size x processes; lower train.batch_size")
    total_steps = tc.max_steps or math.ceil(tc.epochs * batches_per_epoch / tc.grad_accum)
    optimizer = torch.optim.AdamW(params, lr=tc.lr, betas=tuple(tc.betas), weight_decay=tc.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(tc.warmup_steps, total_steps, tc.schedule))
    with head.drafting():  # LoRA weights require grad only while on: DDP must see them when it wraps the head
        head_ddp, optimizer = accelerator.prepare(head, optimizer)

    step, epoch, batch_idx = 0, 0, 0
    if resumed is not None:
        head_state, trainer, pos = resumed
        load_head_state(accelerator.unwrap_model(head_ddp), head_state, ckpt)
        optimizer.load_state_dict(trainer["optimizer"])
        scheduler.load_state_dict(trainer["scheduler"])
        torch.set_rng_state(trainer["torch_rng"])
        step, epoch, batch_idx = pos["step"], pos["epoch"], pos["batch"]
        accelerator.print(f"[train] resumed from {ckpt} at step {step} (epoch {epoch}, batch {batch_idx})")

    # ---- held-out eval set: prompts continued by the target's own greedy decoding
    eval_seqs = eval_sequences(cfg.data, target, tc) if accelerator.is_main_process and tc.eval_prompts else []
    accelerator.init_trackers(cfg.logger.project, config=OmegaConf.to_container(cfg, resolve=True))

    def evaluate() -> dict:
        unwrapped = accelerator.unwrap_model(head_ddp).eval()
        ev = exit_acceptance(unwrapped, target, eval_seqs, tc.eval_depth)
        unwrapped.train()
        return ev

    def save() -> None:
        if accelerator.is_main_process:
            save_state(out, step, accelerator.unwrap_model(head_ddp).state_dict(), optimizer.state_dict(),
                       scheduler.state_dict(), {"epoch": epoch, "batch": batch_idx, "target": target.identity,
                                               "head": head.head_config()},
                       keep=tc.keep_last)
        accelerator.wait_for_everyone()

    # ---- loop
    accelerator.print(f"[train] layerskip exit at layer {E}/{n_layers} ({d.adapter} adapter, {n_params / 1e6:.3f}M "
                      f"trainable params), {len(train_set)} sequences, {batches_per_epoch} batches/epoch/process, "
                      f"{total_steps} optimizer steps")
    bar = tqdm(total=total_steps, initial=step, disable=not accelerator.is_main_process, desc="train", dynamic_ncols=True)
    t_start, tokens_seen, metrics = time.time(), 0, {}
    while step < total_steps:
        for batch_idx, batch in iterate(train_set, tc.batch_size, epoch, tc.seed, accelerator.process_index,
                                        accelerator.num_processes, tok.pad_token_id or 0, start=batch_idx):
            batch = {k: v.to(accelerator.device) for k, v in batch.items()}
            with accelerator.accumulate(head_ddp), accelerator.autocast():
                teacher_states = teacher_of(teacher, batch, E)  # no grad; LoRA (if any) off
                with head.drafting():  # LoRA on for the student's forward AND backward
                    loss, stats = layerskip_loss(head_ddp, head, batch, teacher_states, tc)
                    accelerator.backward(loss)
                if accelerator.sync_gradients and tc.grad_clip_value:
                    accelerator.clip_grad_value_(params, tc.grad_clip_value)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            tokens_seen += int(batch["attention_mask"].sum()) * accelerator.num_processes
            if not accelerator.sync_gradients:
                continue
            scheduler.step()
            step += 1
            batch_idx += 1  # the position to resume from is the next batch
            elapsed = time.time() - t_start
            metrics = {**stats, "lr": scheduler.get_last_lr()[0], "tokens_per_s": tokens_seen / elapsed}
            bar.update(1)
            bar.set_postfix(loss=f"{stats['loss']:.3f}", acc=f"{stats['acc']:.3f}", tps=f"{tokens_seen / elapsed:.0f}")
            if step % tc.log_every == 0:
                accelerator.log(metrics, step=step)
            if tc.eval_every and step % tc.eval_every == 0 and eval_seqs:
                ev = evaluate()
                accelerator.log({f"eval/{k}": v for k, v in ev.items()}, step=step)
                bar.write(f"[eval] step {step}: top1 {ev['top1']:.3f} tau {ev['tau']:.3f}")
            if tc.save_every and step % tc.save_every == 0:
                save()
            budget_hit = tc.max_minutes and elapsed > tc.max_minutes * 60
            if step >= total_steps or any_rank(accelerator, budget_hit):
                total_steps = step
                break
        else:
            epoch, batch_idx = epoch + 1, 0
    bar.close()
    train_time = time.time() - t_start

    # ---- save: resumable state, the head folder, and the single-file export
    print(f"[train] rank {accelerator.process_index} head sha256 "
          f"{state_digest(accelerator.unwrap_model(head_ddp).state_dict())}", flush=True)  # ranks must agree
    save()
    result = {"steps": step, "epochs": round(epoch + batch_idx / max(batches_per_epoch, 1), 3),
              "train_seconds": round(train_time, 1), "tokens_per_s": round(tokens_seen / max(train_time, 1e-9), 1),
              "final_loss": metrics.get("loss"), "final_acc": metrics.get("acc")}
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(head_ddp).eval()
        if eval_seqs:
            result["heldout"] = evaluate()
            accelerator.print(f"[train] held-out top-1 {result['heldout']['top1']:.3f}, chain-{tc.eval_depth} tau "
                              f"{result['heldout']['tau']:.3f}")
        if draft_vocab is not None:
            rows = (r for i, r in zip(range(500), token_rows()))
            result["draft_vocab_coverage"] = round(coverage(draft_vocab, rows), 4)
        record = head_record(unwrapped, target.identity,
                             training={"recipe": "train/layerskip.py", "data": OmegaConf.to_container(cfg.data),
                                       "train": OmegaConf.to_container(tc), "sequences": len(train_set),
                                       "processes": accelerator.num_processes, **result},
                             metrics=result.get("heldout", {}))
        save_head(unwrapped, out / "head", record)
        save_single_file(unwrapped, out / "ckpt.pt", record)
        accelerator.print(f"[train] wrote {out / 'head'} and {out / 'ckpt.pt'}")
    accelerator.end_training()
    return result


@torch.no_grad()
def teacher_of(target_model, batch: dict, exit_layer: int) -> dict[str, torch.Tensor]:
    """The frozen target's layer-E states h_E [B, T, H] and final post-norm features f_L [B, T, H]."""
    if "features" in batch:  # offline: precomputed by scripts/cache_features.py extra_layers=[E]
        return {"h_e": batch[f"layer_{exit_layer}"].float(), "last": batch["features"].float()}
    out = target_model.get_decoder()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                     output_hidden_states=True)
    return {"h_e": out.hidden_states[exit_layer].float(), "last": out.last_hidden_state.float()}


def layerskip_loss(head_ddp, head, batch: dict, teacher: dict, tc: TrainConfig) -> tuple[torch.Tensor, dict]:
    """One micro-batch: the exit at every position t against the target's distribution at t (see the docstring)."""
    ids, attn, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    b, t = ids.shape
    pos = torch.arange(t, device=ids.device)[None].expand(b, -1)
    with torch.no_grad():
        p, inside = soft_labels(head.target_model, teacher["last"], head.draft_vocab)  # [B, T, V_draft], [B, T]
        # position t predicts x_{t+1}: it counts iff x_{t+1} is an assistant token of a real position
        mask = torch.zeros(b, t, device=ids.device)
        mask[:, :-1] = (loss_mask[:, 1:] * attn[:, 1:]).float()
        mask = mask * inside
    if head.adapter_kind == "lora":  # layers 0..E-1 with LoRA on, with gradients (the target's weights frozen)
        h_e = head.prefix(ids, pos, None, attn)
    else:
        h_e = teacher["h_e"]
    z = head_ddp(h_e, pos, attention_mask=attn)  # [B, T, H] pre-norm exit state
    logq = F.log_softmax(head.logits(z).float(), dim=-1)
    denom = mask.sum().clamp(min=1.0)
    tok_loss = (-(p * logq).sum(-1) * mask).sum() / denom
    loss = tc.w_tok * tok_loss
    feat_loss = torch.zeros(())
    if tc.w_feat:
        feat_loss = (F.smooth_l1_loss(head.normed(z).float(), teacher["last"], reduction="none").mean(-1)
                     * mask).sum() / denom
        loss = loss + tc.w_feat * feat_loss
    acc = (((logq.argmax(-1) == p.argmax(-1)).float() * mask).sum() / denom).item()
    return loss, {"loss": loss.item(), "tok_loss": tok_loss.item(), "feat_loss": float(feat_loss), "acc": acc}


@torch.no_grad()
def exit_acceptance(head, target, sequences: list[tuple[torch.Tensor, int]], depth: int) -> dict:
    """Held-out top-1 agreement of the exit with the target, and the chain-`depth` tau of self-speculation.

    sequences: (ids [1, N] = prompt + the target's greedy continuation, prompt length). On the greedy path the
    target's choice at position i is x_{i+1}; a chain rooted at i accepts depth d iff the exit matches at
    i..i+d-1 (its own drafts were the greedy tokens so far, so its context IS the path: see the module docstring)."""
    hits = torch.zeros(depth)
    chains = matched = positions = 0
    for ids, start in sequences:
        n = ids.shape[1]
        pos = torch.arange(n, device=ids.device)[None]
        if head.adapter_kind == "lora":
            h_e = head.prefix(ids, pos)
        else:
            h_e = target.model.get_decoder()(input_ids=ids, output_hidden_states=True).hidden_states[head.exit_layer]
        pred = head.to_target_ids(head.logits(head(h_e, pos)).argmax(-1))[0]  # [N]: predicts x_{i+1}
        first = max(start - 1, 0)  # the root of the first chain: the last prompt token
        match = (pred[first:n - 1] == ids[0, first + 1:]).float()  # [M]
        matched += int(match.sum())
        positions += match.numel()
        run = match
        for d in range(depth):  # run[i] = the matches at i..i+d all hold
            if d:
                run = run[:-1] * match[d:]
            hits[d] += run[: max(match.numel() - depth + 1, 0)].sum()
        chains += max(match.numel() - depth + 1, 0)
    if chains == 0:
        return {"tau": 1.0, "top1": 0.0, "chains": 0}
    cum = hits / chains  # P(first d drafts accepted)
    cond = [float(cum[0])] + [float(cum[d] / cum[d - 1]) if cum[d - 1] > 0 else 0.0 for d in range(1, depth)]
    return {"tau": round(1.0 + float(cum.sum()), 4), "top1": round(matched / max(positions, 1), 4), "chains": chains,
            **{f"acc@{d + 1}": round(c, 4) for d, c in enumerate(cond)}}


def _describe(head_cfg: dict) -> str:
    return f"exit_layer={head_cfg.get('exit_layer')}, adapter={head_cfg.get('adapter')}"


if __name__ == "__main__":
    main()
