"""Train a LayerSkip early-exit adapter on a frozen target: `accelerate launch methods/layerskip/train.py [overrides]`.

Reads top to bottom: config -> accelerator -> frozen target -> data -> head -> optimizer -> loop -> save.
Distillation from the target itself, at every position t (no shift: the exit at t and the final layer at t both
predict token t+1):
    loss = w_tok * softCE(p_L(. | x_<=t), q_E(. | x_<=t)) + w_feat * SmoothL1(norm(exit_t), f_L,t)   (`layerskip.*`)
p_L: the target's final-layer distribution (temperature-free), restricted to the draft vocabulary; q_E: the
exit's. softCE = KL(p_L || q_E) + H(p_L), the same gradients as the KL. Positions whose next token is not an
assistant token, or whose target argmax the draft vocabulary cannot express, are masked out. The feature term
(default weight 0) regresses the exit's post-norm state onto the target's final post-norm features.

Teacher inputs: online, one no-grad target pass (hidden_states[E] and the last hidden state); offline, the
features folder of scripts/cache_features.py with extra_layers=[E]. adapter=lora runs layers 0..E-1 itself with
its LoRA on (and gradients), the teacher pass with it off.

Held-out eval: selfspec.eval.acceptance.exit_acceptance (top-1 agreement and the chain tau of self-speculation, from
one exit pass over the target's own greedy continuations).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from selfspec.core.cli import entry, read_once
from selfspec.core.errors import UserError
from selfspec.methods.layerskip.head import build_layerskip
from selfspec.eval.acceptance import exit_acceptance
from selfspec.train.config import RunConfig, draft_schemas
from selfspec.train.features import feature_model, soft_labels, training_data
from selfspec.train.loop import conclude, optimizer_step, train_loop
from selfspec.train.preamble import draft_vocab, open_run, start
from selfspec.train.run import UNREAD, moved_keys, resume_point, run_record


@dataclass
class LayerSkipLossConfig:
    """The exit's distillation loss (`layerskip.*`); the exit's shape is `draft.*`
    (methods/layerskip/conf/draft/layerskip.yaml)."""

    w_tok: float = field(default=1.0, metadata={"help": (
        "weight of the soft cross-entropy of the exit against the target's final-layer distribution (the KL term)")})
    w_feat: float = field(default=0.0, metadata={"help": (
        "weight of the SmoothL1 of the exit's post-norm state onto the target's final post-norm features; 0: off")})


# the shared train: schema's loss knobs of before issue 51: two moved here, the others never read (train/run.py)
OLD_KEYS = {**UNREAD, "train.w_tok": "layerskip.w_tok", "train.w_feat": "layerskip.w_feat"}


@dataclass
class TrainLayerSkipConfig(RunConfig):
    layerskip: LayerSkipLossConfig = field(default_factory=LayerSkipLossConfig)
    RENAMED: ClassVar[dict[str, str]] = moved_keys(OLD_KEYS)  # train.w_tok -> layerskip.w_tok ...


@entry("train_layerskip", TrainLayerSkipConfig, draft_schemas())
def main(cfg) -> dict:
    d = cfg.draft
    if d.type != "layerskip":
        raise UserError(f"methods/layerskip/train.py trains draft=layerskip heads, not '{d.type}'")
    tc = cfg.train
    accelerator, target = open_run(cfg)  # output_dir taken, torch seeded, the frozen target on the device
    tok = target.tokenizer
    teacher = feature_model(target.model, tc.features_dtype)  # the target (or its bf16 copy) making features
    E, n_layers = int(d.exit_layer), target.identity["num_hidden_layers"]
    if not 1 <= E < n_layers:
        raise UserError(f"draft.exit_layer={E}: train an exit in 1..{n_layers - 1} (exit_layer={n_layers} is the "
                        f"target itself)")

    # ---- data: token ids + assistant loss mask; offline: plus the target's final features and layer E
    train_set, token_rows = training_data(cfg.data, target, accelerator, layers=[E],
                                          offline_hint=f" extra_layers=[{E}]")

    # ---- run identity (what shapes the result: output_dir/run.json) and resume point: it must be the same exit
    # (layer, adapter); its draft vocabulary is reused as saved
    record = run_record(cfg, "methods/layerskip/train.py", target.identity, len(train_set), accelerator)
    resumed = resume_point(cfg, record, target.identity, accelerator)

    # ---- head: the exit at layer E, reduced vocabulary if asked
    head = build_layerskip(target.model, exit_layer=E, adapter=d.adapter, rank=d.rank,
                           init_from_target=d.init_from_target, lora_rank=d.lora_rank, lora_alpha=d.lora_alpha,
                           lora_targets=list(d.lora_targets), vocab_size=d.vocab_size,
                           draft_vocab=draft_vocab(resumed, d.vocab_size, target, token_rows))
    if resumed is not None:
        was = resumed.position.get("head")
        if was is not None and was != head.head_config():
            raise UserError(f"{resumed.folder} holds a different exit ({_describe(was)}) than draft= asks "
                            f"({_describe(head.head_config())}); use another output_dir or resume=never")
    params = head.trainable_parameters()
    n_params = sum(p.numel() for p in params)

    # ---- the run: the head in fp32, optimizer and schedule (LoRA on while DDP wraps the head), the checkpoint being
    # continued, the held-out set (prompts continued by the target's own greedy decoding), the trackers
    run, eval_seqs = start(cfg, accelerator, target, head, params, len(train_set), record, resumed,
                           position={"head": head.head_config()})

    lc = read_once(cfg.layerskip, LayerSkipLossConfig)  # read once: the loss reads it every micro-step

    def micro_step(batch: dict) -> dict:
        """One micro-batch: the teacher pass (LoRA off), the exit's loss (LoRA on), the optimizer's step."""
        with accelerator.accumulate(run.head_ddp), accelerator.autocast():
            teacher_states = teacher_of(teacher, batch, E)  # no grad; LoRA (if any) off
            with head.drafting():  # LoRA on for the student's forward AND backward
                loss, stats = layerskip_loss(run.head_ddp, head, batch, teacher_states, lc)
                accelerator.backward(loss)
            optimizer_step(run)
        return stats

    def evaluate(head) -> dict:
        ev = exit_acceptance(head.eval(), target, eval_seqs, tc.eval_depth)
        head.train()
        return ev

    # ---- loop
    accelerator.print(f"[train] layerskip exit at layer {E}/{n_layers} ({d.adapter} adapter, {n_params / 1e6:.3f}M "
                      f"trainable params), {len(train_set)} sequences, {run.batches_per_epoch} batches/epoch/process, "
                      f"{run.total_steps} optimizer steps")
    train_loop(run, train_set, tok.pad_token_id or 0, micro_step, evaluate if tc.eval_prompts else None,
               eval_line=lambda ev: f"top1 {ev['top1']:.3f} tau {ev['tau']:.3f}")

    # ---- save: resumable state, the held-out eval, the head folder and the single-file export
    training = {"recipe": "methods/layerskip/train.py", "data": OmegaConf.to_container(cfg.data),
                "train": OmegaConf.to_container(tc), "layerskip": OmegaConf.to_container(cfg.layerskip),
                "sequences": len(train_set)}
    return conclude(run, evaluate if eval_seqs else None,
                    lambda ev: f"top-1 {ev['top1']:.3f}, chain-{tc.eval_depth} tau {ev['tau']:.3f}",
                    token_rows, target.identity, training, {"final_acc": run.metrics.get("acc")})


@torch.no_grad()
def teacher_of(target_model, batch: dict, exit_layer: int) -> dict[str, torch.Tensor]:
    """The frozen target's layer-E states h_E [B, T, H] and final post-norm features f_L [B, T, H]."""
    if "features" in batch:  # offline: precomputed by scripts/cache_features.py extra_layers=[E]
        return {"h_e": batch[f"layer_{exit_layer}"].float(), "last": batch["features"].float()}
    out = target_model.get_decoder()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                     output_hidden_states=True)
    return {"h_e": out.hidden_states[exit_layer].float(), "last": out.last_hidden_state.float()}


def layerskip_loss(head_ddp, head, batch: dict, teacher: dict,
                   lc: LayerSkipLossConfig) -> tuple[torch.Tensor, dict]:
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
    loss = lc.w_tok * tok_loss
    feat_loss = torch.zeros(())
    if lc.w_feat:
        feat_loss = (F.smooth_l1_loss(head.normed(z).float(), teacher["last"], reduction="none").mean(-1)
                     * mask).sum() / denom
        loss = loss + lc.w_feat * feat_loss
    acc = (((logq.argmax(-1) == p.argmax(-1)).float() * mask).sum() / denom).item()
    return loss, {"loss": loss.item(), "tok_loss": tok_loss.item(), "feat_loss": float(feat_loss), "acc": acc}


def _describe(head_cfg: dict) -> str:
    return f"exit_layer={head_cfg.get('exit_layer')}, adapter={head_cfg.get('adapter')}"


if __name__ == "__main__":
    main()
