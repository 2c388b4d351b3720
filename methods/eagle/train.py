"""Train an EAGLE-1/2 head from a frozen target: `accelerate launch methods/eagle/train.py [overrides]`.

Reads top to bottom: config -> accelerator -> frozen target -> data -> head -> optimizer -> loop -> save.
Loss (EAGLE, arXiv 2401.15077, and its reference code; the knobs are `eagle.*`, EagleLossConfig):
w_feat * SmoothL1(pred f_{t+1}, f_{t+1}) + w_tok * soft CE(target p_{t+1}, head q_{t+1}), both masked to positions
whose predicted token is an assistant token, normalised by the mask sum.

`ttt.steps=1` (the default) is EAGLE-1's teacher-forced loss. `ttt.steps=n > 1` adds a training-time test (as
HASS and EAGLE-3 do): the head also continues every chain on its OWN predicted features for n-1 more steps
(train/rollout.ttt_unroll, the attention pattern of decoding), with the same two losses at each step against the
target's feature and distribution there, weighted decay^j. Decoding feeds the head its own features from the
second draft on; a head trained only on the target's features drifts there (acceptance at depth 2 falls).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch.profiler import record_function

from selfspec.core.cli import entry, read_once
from selfspec.heads.layers import check_layer, recorded_layer
from selfspec.methods.eagle.head import build_eagle
from selfspec.core.errors import UserError
from selfspec.eval.acceptance import chain_acceptance
from selfspec.train.config import RunConfig, draft_schemas
from selfspec.train.features import feature_model, soft_labels, training_data
from selfspec.data.features import last_features
from selfspec.train.loop import conclude, optimizer_step, train_loop
from selfspec.train.preamble import draft_vocab, feature_memo, head_to_continue, open_run, start
from selfspec.train.run import EAGLE1_TRAIN_KEYS, moved_keys, resume_point, run_record
from selfspec.train.rollout import TTTConfig, acceptance, shift, ttt_unroll


@dataclass
class EagleLossConfig:
    """The EAGLE-1/2 loss (`eagle.*`); the head's shape is `draft.*` (methods/eagle/conf/draft/eagle.yaml)."""

    w_feat: float = field(default=1.0, metadata={"help": "weight of the SmoothL1 feature-regression loss"})
    w_tok: float = field(default=0.1, metadata={"help": (
        "weight of the soft cross-entropy against the target's distribution")})
    topk: int = field(default=0, metadata={"help": (
        "HASS's harmonized distillation: add w_topk x the soft cross-entropy over the target's top-k tokens only "
        "(k=10 in HASS); 0 disables")})
    w_topk: float = field(default=1.0, metadata={"help": "weight of the top-k term, relative to the soft CE"})
    noise_std: float = field(default=0.2, metadata={"help": (
        "uniform noise (U-0.5)*noise_std*512/seq_len on input features (drawn from train.seed's stream); 0 disables")})


@dataclass
class EagleTTTConfig(TTTConfig):
    """The training-time test (`ttt.*`) as this recipe runs it: off by default, with Draft-OPD's weights."""

    steps: int = field(default=1, metadata={"help": (
        "draft steps unrolled per position in training (1 = EAGLE-1's loss; see the module docstring)")})
    on_policy: bool = field(default=False, metadata={"help": (
        "weight each chain's step j by the chance decoding reaches it (the product of its earlier steps' "
        "acceptance, sum min(p, q)) times 1 + its own rejection chance, Draft-OPD style: the positions decoding "
        "meets, the rejected ones most (no gradient through the weights)")})


# the loss knobs the shared train: schema held before this recipe owned its loss (train/run.py old_keys)
OLD_KEYS = {f"train.{k}": f"eagle.{k}" for k in EAGLE1_TRAIN_KEYS}


@dataclass
class TrainEagleConfig(RunConfig):
    eagle: EagleLossConfig = field(default_factory=EagleLossConfig)
    ttt: EagleTTTConfig = field(default_factory=EagleTTTConfig)
    RENAMED: ClassVar[dict[str, str]] = moved_keys(OLD_KEYS)  # train.w_feat -> eagle.w_feat ...


@entry("train_eagle", TrainEagleConfig, draft_schemas())
def main(cfg) -> dict:
    if cfg.draft.type != "eagle":
        raise UserError(f"methods/eagle/train.py trains draft=eagle heads, not '{cfg.draft.type}'")
    check_layer(cfg.draft.layer)  # before the target and the data load
    if cfg.draft.init_from and cfg.draft.init_from_layer is not None:
        raise UserError("draft.init_from fine-tunes a whole head and draft.init_from_layer starts a fresh one from a "
                        "target layer: pass one of them")
    tc = cfg.train
    accelerator, target = open_run(cfg)  # output_dir taken, torch seeded, the frozen target on the device
    tok = target.tokenizer
    teacher = feature_model(target.model, tc.features_dtype)  # the target (or its bf16 copy) making features

    # ---- data: token ids + assistant loss mask (rank 0 tokenises first and fills the datasets cache);
    # offline: the same plus the target's features, precomputed by scripts/cache_features.py
    train_set, token_rows = training_data(cfg.data, target, accelerator)

    # ---- run identity (what shapes the result: output_dir/run.json) and resume point (its draft vocabulary is
    # reused as saved, never rebuilt)
    record = run_record(cfg, "methods/eagle/train.py", target.identity, len(train_set), accelerator)
    resumed = resume_point(cfg, record, target.identity, accelerator)

    # ---- head (random init, one target layer copied in, or a head to fine-tune), reduced vocabulary if asked
    d = cfg.draft
    init = head_to_continue(d.init_from, "draft.init_from", "eagle", target)  # (record, state) or None
    if init is None:
        head = build_eagle(target.model, num_layers=d.num_layers, fc_bias=d.fc_bias, vocab_size=d.vocab_size,
                           init_from_layer=d.init_from_layer, layer=d.layer,
                           draft_vocab=draft_vocab(resumed, d.vocab_size, target, token_rows))
    else:  # a fine-tune keeps the start head's shape and draft vocabulary (a resume's are the same ones)
        shape, kept = init[0]["head"], init[1].get("draft_vocab")
        own = {"num_layers": shape["num_layers"], "fc_bias": shape["fc_bias"],
               "vocab_size": None if kept is None else kept.numel(), "layer": recorded_layer(shape)}
        said = [f"draft.{k}={d[k]}" for k, v in own.items() if d[k] != v and not (k == "layer" and v == "target")]
        if said:  # (a record without `layer` holds the target family's; draft.layer's default says llama)
            accelerator.print(f"[train] {', '.join(said)} ignored: keeping the head being continued "
                              f"({', '.join(f'{k}={v}' for k, v in own.items())}; never rebuilt)")
        head = build_eagle(target.model, draft_vocab=kept, **own)
        if resumed is None:
            head.load_state_dict(init[1])
    params = [p for p in head.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)

    # ---- the run: the head in fp32, optimizer and schedule, the checkpoint being continued, the held-out set
    # (prompts continued by the target's own greedy decoding), the trackers
    run, eval_seqs = start(cfg, accelerator, target, head, params, len(train_set), record, resumed, init=init)
    memo = feature_memo(cfg, last_features(teacher, argmax=head.draft_vocab is not None))
    lc, ttt = read_once(cfg.eagle, EagleLossConfig), read_once(cfg.ttt, EagleTTTConfig)  # read once: used every step

    def evaluate(head) -> dict:
        ev = chain_acceptance(head.eval(), target, eval_seqs, tc.eval_depth)
        head.train()
        return ev

    # ---- loop
    accelerator.print(f"[train] head {n_params / 1e6:.2f}M params, {len(train_set)} sequences, "
                      f"{run.batches_per_epoch} batches/epoch/process, {run.total_steps} optimizer steps")
    train_loop(run, train_set, tok.pad_token_id or 0,
               lambda batch: micro_step(run, teacher, memo, batch, lc, ttt), evaluate)

    # ---- save: resumable state, the held-out eval, the head folder and the single-file export
    training = {"recipe": "methods/eagle/train.py", "data": OmegaConf.to_container(cfg.data),
                "train": OmegaConf.to_container(tc), "eagle": OmegaConf.to_container(cfg.eagle),
                "ttt": OmegaConf.to_container(cfg.ttt), "init_from": d.init_from, "sequences": len(train_set)}
    return conclude(run, evaluate if eval_seqs else None, lambda ev: f"chain-{tc.eval_depth} tau {ev['tau']:.3f}",
                    token_rows, target.identity, training, {"final_acc": run.metrics.get("acc")})


def micro_step(run, teacher, memo, batch: dict, lc: EagleLossConfig, ttt: EagleTTTConfig) -> dict:
    """One micro-batch: features and argmax (from the memo once seen), the loss, backward, the optimizer's step.
    Its phases are torch.profiler ranges (record_function: nothing without a profiler): scripts/profile_step.py
    runs this very function and reads them."""
    accelerator = run.accelerator
    if memo is not None:
        with record_function("memo"):
            batch.update(memo(batch))
    with accelerator.accumulate(run.head_ddp), accelerator.autocast():
        loss, stats = eagle_loss(run.head_ddp, run.head, teacher, batch, lc, ttt)
        with record_function("backward"):
            accelerator.backward(loss)
        with record_function("optimizer"):
            optimizer_step(run)
    return {"loss": stats["loss"], "feat_loss": stats["feat"], "tok_loss": stats["tok"], "acc": stats["acc"]}


def eagle_loss(head_ddp, head, target_model, batch: dict, lc: EagleLossConfig,
               ttt: EagleTTTConfig = EagleTTTConfig()) -> tuple[torch.Tensor, dict]:
    """One micro-batch. Shift by one: the pair (f_t, x_{t+1}) predicts f_{t+1}, hence the token x_{t+2}."""
    if ttt.steps > 1 or ttt.on_policy:
        return unrolled_loss(head_ddp, head, target_model, batch, lc, ttt)
    ids, attn, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    feats = target_features(target_model, batch)  # [B, T, H]
    b, t, _ = feats.shape
    inp, tgt = feats[:, :-1], feats[:, 1:]  # f_t and f_{t+1}: [B, T-1, H]
    if lc.noise_std:
        # EAGLE's uniform noise on input features only, scaled by 512 / sequence length.
        inp = inp + (torch.rand_like(inp) - 0.5) * lc.noise_std * 512 / t
    pos = torch.arange(t - 1, device=ids.device)[None].expand(b, -1)
    with record_function("head forward"):
        pred = head_ddp(inp, ids[:, 1:], pos, attention_mask=attn[:, 1:])  # [B, T-1, H]
    # Mask: the token f_{t+1} predicts (x_{t+2}) is an assistant token of a real (non-pad) position.
    mask = torch.zeros_like(loss_mask[:, 1:], dtype=torch.float)
    mask[:, :-1] = (loss_mask[:, 2:] * attn[:, 2:]).float()
    argmax = batch.get("target_argmax")  # kept by the feature memo; else soft_labels computes it
    # the target's distribution at t+1: [B, T-1, V_draft]
    p, inside = soft_labels(target_model, tgt, head.draft_vocab, None if argmax is None else argmax[:, 1:])
    with record_function("loss"):
        feat_loss, tok_loss, acc = eagle_terms(head.logits(pred), pred, tgt, p, mask * inside, lc.topk, lc.w_topk)
        loss = lc.w_feat * feat_loss + lc.w_tok * tok_loss
        return loss, {"loss": loss.item(), "feat": feat_loss.item(), "tok": tok_loss.item(), "acc": acc}


def target_features(target_model, batch: dict) -> torch.Tensor:
    """The target's post-norm last hidden states [B, T, H] (fp32): precomputed (offline, or the feature memo) or
    computed here by the frozen target, without gradients."""
    if "features" in batch:
        return batch["features"].float()
    with torch.no_grad(), record_function("target forward"):
        return target_model.get_decoder()(input_ids=batch["input_ids"],
                                          attention_mask=batch["attention_mask"]).last_hidden_state.float()


def unrolled_loss(head_ddp, head, target_model, batch: dict, lc: EagleLossConfig,
                  ttt: EagleTTTConfig) -> tuple[torch.Tensor, dict]:
    """eagle_loss with a training-time test: step j continues every chain t on the head's own output and is
    scored against the target's feature f_{t+1+j} and distribution for x_{t+2+j} (weight decay^j)."""
    ids, attn, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    feats = target_features(target_model, batch)  # [B, T, H]
    # the target's distribution for x_{t+1}
    p, inside = soft_labels(target_model, feats, head.draft_vocab, batch.get("target_argmax"))
    valid = (loss_mask * attn).float()
    inp = feats
    if lc.noise_std:  # EAGLE's uniform noise on the step-0 input features
        inp = feats + (torch.rand_like(feats) - 0.5) * lc.noise_std * 512 / feats.shape[1]
    loss = torch.zeros((), device=ids.device)
    stats = {}
    reach = torch.ones_like(valid)  # on_policy: the chance chain t's draft gets to step j
    for j, pred in enumerate(ttt_unroll(head_ddp, inp, ids, attn, ttt.steps)):  # pred[t] predicts f_{t+1+j}
        with record_function("loss"):
            mask = shift(valid, 2 + j) * shift(inside, 1 + j)  # x_{t+2+j} is a real assistant token the vocab holds
            logits, p_j, weight = head.logits(pred), shift(p, 1 + j), None
            if ttt.on_policy:
                accept = acceptance(p_j, logits)
                weight, reach = reach * (2.0 - accept), reach * accept
            feat, tok, stats[f"acc_{j}"] = eagle_terms(logits, pred, shift(feats, 1 + j), p_j, mask, lc.topk,
                                                       lc.w_topk, weight)
            loss = loss + ttt.decay ** j * (lc.w_feat * feat + lc.w_tok * tok)
            if j == 0:
                stats.update(feat=feat.item(), tok=tok.item(), acc=stats["acc_0"])
    with record_function("loss"):
        stats["loss"] = loss.item()
    return loss, stats


def eagle_terms(logits: torch.Tensor, pred: torch.Tensor, target_feats: torch.Tensor, p: torch.Tensor,
                mask: torch.Tensor, topk: int = 0, w_topk: float = 1.0,
                weight: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, float]:
    """One draft step's EAGLE loss terms, each averaged over `mask` (float [B, T]): SmoothL1 of the predicted
    features against the target's, soft cross-entropy of the draft logits against the target's distribution `p`
    (plus, with `topk`, w_topk x the same sum over the target's top-k tokens only: HASS's harmonized distillation),
    and top-1 agreement with it (a float, for logging). `weight` [B, T] (no gradient) reweights the positions of
    the two losses: their average is then over mask x weight."""
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


if __name__ == "__main__":
    main()
