"""Train a P-EAGLE head (parallel drafting): `accelerate launch methods/peagle/train.py [overrides]`.

Reads top to bottom: config -> accelerator -> frozen target -> data -> head -> optimizer -> loop -> save.

One head pass per micro-batch (peagle/head.py parallel_layout): the T real pairs (aux_t, x_{t+1}) at positions t,
then for each depth d = 1..K-1 a mask slot at position t + d for the anchors t of S_d (conditional drop-token
sampling: S_d is drawn from S_{d-1}, about T * max(r^d, r_min) of them, `peagle.down_sample_ratio[_min]`). Slot (t, d)
attends to the real pairs u <= t and its own chain's slots up to d, exactly as decoding's pass over [anchor,
K-1 slots] does. Depth d's output at anchor t predicts x_{t+2+d}: soft CE against the target's distribution there,
restricted to the draft vocabulary, weight decay^d, on assistant tokens whose target argmax the vocabulary holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from omegaconf import OmegaConf

from selfspec.core.cli import entry, read_once
from selfspec.core.errors import UserError
from selfspec.methods.peagle.acceptance import parallel_acceptance
from selfspec.methods.peagle.head import BASE, build_peagle, cod_anchors, default_aux_layers, run_parallel
from selfspec.train.aux_teacher import masked_soft_ce, memo_features, teacher_signals
from selfspec.train.config import RunConfig, draft_schemas
from selfspec.train.features import feature_model, training_data
from selfspec.train.loop import conclude, memo_step, train_loop
from selfspec.train.preamble import feature_memo, head_to_continue, open_run, start, vocab_maps
from selfspec.train.run import UNREAD, resume_point, run_record

# the shared train: schema's loss knobs of before issue 51, which this recipe never read (train/run.py old_keys)
OLD_KEYS = UNREAD


@dataclass
class PEagleLossConfig:
    """The P-EAGLE loss (`peagle.*`)."""

    down_sample_ratio: float = field(default=0.7, metadata={"help": (
        "COD: depth d drafts from about T * ratio^d anchors of each sequence, drawn from depth d-1's")})
    down_sample_ratio_min: float = field(default=0.2, metadata={"help": "COD: never fewer than T * this anchors"})
    decay: float = field(default=0.8, metadata={"help": (
        "loss weight of depth d (0: the anchor's own token) is decay**d")})


@dataclass
class TrainPEagleConfig(RunConfig):
    peagle: PEagleLossConfig = field(default_factory=PEagleLossConfig)


@entry("train_peagle", TrainPEagleConfig, draft_schemas())
def main(cfg) -> dict:
    if cfg.draft.type != "peagle":
        raise UserError(f"methods/peagle/train.py trains draft=peagle heads, not '{cfg.draft.type}'")
    loss_cfg = read_once(cfg.peagle, PEagleLossConfig)  # read once: the loss reads it every micro-step
    for key in ("down_sample_ratio", "down_sample_ratio_min"):
        if not 0 < getattr(loss_cfg, key) <= 1:
            raise UserError(f"peagle.{key} must be in (0, 1], not {getattr(loss_cfg, key)}")
    tc, d = cfg.train, cfg.draft
    accelerator, target = open_run(cfg)  # output_dir taken, torch seeded, the frozen target on the device
    tok = target.tokenizer
    teacher = feature_model(target.model, tc.features_dtype)

    # ---- warm start: an EAGLE-3 head gives fc, the first layer, norm, lm_head and its vocabulary; a peagle head all
    init = head_to_continue(d.init_from, "draft.init_from", (BASE, "peagle"), target)
    n_layers = target.identity["num_hidden_layers"]
    shape = {"num_layers": d.num_layers, "depth": d.depth, "mask_token_id": d.mask_token_id}
    if init:
        recorded = init[0]["head"]
        aux_layers = list(recorded["aux_layers"])
        if recorded["type"] == "peagle":  # its layers and mask are its own; only the depth trained for may change
            shape.update(num_layers=recorded["num_layers"], mask_token_id=recorded["mask_token_id"])
    else:
        aux_layers = list(d.aux_layers) if d.aux_layers is not None else default_aux_layers(n_layers)
    if not aux_layers or any(not 0 <= k < n_layers for k in aux_layers):
        raise UserError(f"draft.aux_layers={list(aux_layers)}: each must be a target layer id in [0, {n_layers - 1}] "
                        f"(HF hidden_states[k], the un-normed residual stream after k layers)")

    with torch.random.fork_rng(devices=[]):  # the shape checked (one line) before any data is read, off the RNG
        probe = build_peagle(target.model, aux_layers=aux_layers, tokenizer=tok, **shape)
    shape["mask_token_id"] = probe.mask_token_id
    del probe

    # ---- data, run identity and resume point (as EAGLE-3's recipe)
    train_set, token_rows = training_data(cfg.data, target, accelerator, layers=aux_layers)
    record = run_record(cfg, "methods/peagle/train.py", target.identity, len(train_set), accelerator)
    resumed = resume_point(cfg, record, target.identity, accelerator)

    kept = resumed.head_state if resumed else init[1] if init else None
    head = build_peagle(target.model, aux_layers=aux_layers, tokenizer=tok, **shape,
                        **vocab_maps(kept, d.vocab_size, target, token_rows, accelerator))
    if init is not None and resumed is None:
        missing, unexpected = head.load_state_dict(init[1], strict=False)
        fresh = [k for k in missing if k != "mask_hidden" and not k.startswith("layers.") or k.startswith("layers.0.")]
        if unexpected or fresh:  # e.g. an EAGLE-3 head with a Qwen or Gemma layer (layer=target): not a Llama layer
            what = f"no place for {', '.join(unexpected[:3])}" if unexpected else f"missing {', '.join(fresh[:3])}"
            raise UserError(f"draft.init_from '{d.init_from}' does not fit a peagle head (Llama layers): {what}")
    params = [p for p in head.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)
    run, eval_seqs = start(cfg, accelerator, target, head, params, len(train_set), record, resumed, init=init)
    memo = feature_memo(cfg, memo_features(run.head, teacher))

    micro_step = memo_step(run, memo, lambda batch: parallel_loss(run.head_ddp, run.head, teacher, batch, loss_cfg))

    def evaluate(head) -> dict:
        ev = parallel_acceptance(head.eval(), target, eval_seqs)
        head.train()
        return ev

    accelerator.print(f"[train] peagle head {n_params / 1e6:.2f}M params, {len(head.layers)} layer(s), depth "
                      f"{head.depth}, aux layers {aux_layers}, draft vocab {head.d2t.numel()}, mask token "
                      f"{head.mask_token_id}, {len(train_set)} sequences, {run.batches_per_epoch} "
                      f"batches/epoch/process, {run.total_steps} optimizer steps")
    train_loop(run, train_set, tok.pad_token_id or 0, micro_step, evaluate, postfix={"loss": "loss", "acc0": "acc_0"})

    training = {"recipe": "methods/peagle/train.py", "data": OmegaConf.to_container(cfg.data),
                "train": OmegaConf.to_container(tc), "peagle": OmegaConf.to_container(cfg.peagle),
                "init_from": d.init_from, "sequences": len(train_set)}
    return conclude(run, evaluate if eval_seqs else None, lambda ev: f"parallel-{head.depth} tau {ev['tau']:.3f}",
                    token_rows, target.identity, training,
                    {k: v for k, v in run.metrics.items() if k.startswith("acc_")})


def parallel_loss(head_ddp, head, target_model, batch: dict, loss_cfg) -> tuple[torch.Tensor, dict]:
    """One micro-batch: one head pass over the real pairs and the COD-sampled slots (see the module docstring)."""
    ids, attn = batch["input_ids"], batch["attention_mask"]
    aux, p, inside, valid = teacher_signals(head, target_model, batch)
    t = ids.shape[1]
    anchors = cod_anchors(t, head.depth, loss_cfg.down_sample_ratio, loss_cfg.down_sample_ratio_min, ids.device)
    next_ids = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)  # x_{t+1} beside aux_t (the last pair is never scored)
    outs = run_parallel(head_ddp, aux, next_ids, attn, anchors)
    loss = torch.zeros((), device=ids.device)
    stats = {}
    for depth, (out, at) in enumerate(zip(outs, [torch.arange(t, device=ids.device), *anchors])):
        want = at + 1 + depth  # out at anchor a predicts x_{a+2+depth}: the target's distribution at a+1+depth
        ok = (want + 1 < t).float()[None]
        want = want.clamp(max=t - 1)
        mask = valid[:, (want + 1).clamp(max=t - 1)] * inside[:, want] * ok  # [B, n_d]
        ce, acc = masked_soft_ce(head.logits(out), p[:, want], mask)
        loss = loss + loss_cfg.decay ** depth * ce
        stats[f"ce_{depth}"], stats[f"acc_{depth}"] = ce.item(), acc
    stats["loss"] = loss.item()
    return loss, stats


if __name__ == "__main__":
    main()
