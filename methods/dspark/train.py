"""Train a DSpark head on a frozen target: `accelerate launch methods/dspark/train.py [overrides]`.

Reads top to bottom: config -> accelerator -> frozen target -> data -> head -> optimizer -> loop -> save; the
pieces are DFlash's recipe's (methods/dflash/train.py: its anchor sampler and feature memo) and the shared loop.

Each sequence gets `dspark.anchors` random anchors a (assistant tokens whose S drafts lie in the sequence: a + S a
real position). Block a = [x_a, MASK x (S-1)] sees the target's fused context at positions u < a and itself (DFlash's
training call, all blocks of a batch in one pass). Slot k (0..S-1), at position a+k, predicts token a+k+1 and is
chained on the token before it (speculators' sample_from_anchor, models/dspark/core.py):
    label  y_{a+k+1} = argmax of the target's logits at position a+k (its greedy token, NOT the data token)
    prev   x_a for slot 0, else y_{a+k}: the token the drafter has drawn there whenever slot k is reached accepted
    loss   ce: -log q_k(y_{a+k+1}), q_k = softmax(DFlash logits + markov bias(prev_k)); kl: soft CE against the
           target's distribution at a+k over the draft vocabulary
    weight w_k = exp(-k/gamma) (speculators' decay for anchor-first slots), loss = sum(w * l * m) / sum(w * m)
    m      1 where token a+k+1 is an assistant token and y_{a+k+1} is in the draft vocabulary
    conf   + confidence_alpha * BCE(conf_k, 1[argmax q_k == y_{a+k+1}]), same weights, m without the vocabulary
           condition (a label outside it is never accepted: the head learns 0 there). The target is the greedy
           acceptance of the slot; speculators' is 1 - TV(q_k, p_k), the acceptance when sampling at temperature 1.
The Markov head and the confidence head train with the body, all from the start. Held-out eval:
methods/dspark/acceptance.py (one block of S at every position of the target's greedy continuations).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from selfspec.core.cli import entry, read_once
from selfspec.core.errors import UserError
from selfspec.target.model import lm_logits
from selfspec.methods.dflash.train import memo_features, sample_anchors
from selfspec.methods.dspark.acceptance import block_acceptance
from selfspec.methods.dspark.head import build_dspark
from selfspec.train.config import RunConfig, draft_schemas
from selfspec.train.features import feature_model, soft_labels, training_data
from selfspec.train.loop import conclude, memo_step, train_loop
from selfspec.train.preamble import feature_memo, head_to_continue, open_run, start, vocab_maps
from selfspec.train.run import resume_point, run_record

LOSSES = ("ce", "kl")
SHAPE = ("block_size", "num_layers", "mask_token_id", "target_layer_ids", "markov_rank", "confidence_head")


@dataclass
class DSparkTrainConfig:
    """The DSpark loss (`dspark.*`); the head's shape is `draft.*` (methods/dspark/conf/draft/dspark.yaml)."""

    anchors: int = field(default=64, metadata={"help": (
        "Blocks per sequence: random anchors among its assistant tokens whose S drafts lie in the sequence; fewer "
        "when it has fewer. speculators trains up to 512 per sequence on GPUs; 64 keeps a step cheap on a CPU.")})
    loss: str = field(default="ce", metadata={"help": (
        "ce: cross-entropy against the target's greedy token at each slot (argmax of its logits, not the data "
        "token); kl: soft cross-entropy (KL up to a constant) against the target's distribution there, restricted "
        "to the draft vocabulary (speculators' default kl_div).")})
    gamma: Optional[float] = field(default=None, metadata={"help": (
        "Position decay: slot k (0..S-1) weighs exp(-k/gamma). null = 1 + 3*S/8, DFlash's rule (4 for S=8; "
        "speculators uses 4).")})
    confidence_alpha: float = field(default=1.0, metadata={"help": (
        "Weight of the confidence head's BCE against each slot's greedy acceptance (speculators' "
        "confidence_head_alpha, 1.0); 0 leaves the confidence head untrained.")})
    init_from: Optional[str] = field(default=None, metadata={"help": (
        "A dspark head to fine-tune: its weights, shape (block size, layers, target layer ids, mask id, Markov rank, "
        "confidence head) and its d2t/t2d (never rebuilt) are the start; draft.* then only has to name "
        "draft=dspark.")})


@dataclass
class TrainDSparkConfig(RunConfig):
    dspark: DSparkTrainConfig = field(default_factory=DSparkTrainConfig)


@entry("train_dspark", TrainDSparkConfig, draft_schemas())
def main(cfg) -> dict:
    # dspark.* read once, as its schema's values: the loss closure uses them every micro-step
    d, dc, tc = cfg.draft, read_once(cfg.dspark, DSparkTrainConfig), cfg.train
    if d.type != "dspark":
        raise UserError(f"methods/dspark/train.py trains draft=dspark heads, not '{d.type}'")
    if dc.anchors < 1:
        raise UserError(f"dspark.anchors must be >= 1, not {dc.anchors}")
    if dc.loss not in LOSSES:
        raise UserError(f"dspark.loss={dc.loss!r}: use ce (the target's greedy tokens) or kl (its distribution)")
    if dc.gamma is not None and not dc.gamma > 0:
        raise UserError(f"dspark.gamma must be > 0 (or null: derived from the block size), not {dc.gamma}")
    if not dc.confidence_alpha >= 0:
        raise UserError(f"dspark.confidence_alpha must be >= 0, not {dc.confidence_alpha}")
    accelerator, target = open_run(cfg)  # output_dir taken, torch seeded, the frozen target on the device
    tok = target.tokenizer
    teacher = feature_model(target.model, tc.features_dtype)  # the target (or its bf16 copy) making features

    # ---- the head's shape: a head to fine-tune keeps its own; checked (one line) before any data is read by
    # building it once, outside the seeded RNG stream (the head trained is built below, with its vocabulary)
    init = head_to_continue(dc.init_from, "dspark.init_from", "dspark", target)  # (record, state) or None
    source = init[0]["head"] if init else d
    shape = {k: source[k] for k in SHAPE if k in source}
    if shape.get("target_layer_ids") is not None:
        shape["target_layer_ids"] = list(shape["target_layer_ids"])
    with torch.random.fork_rng(devices=[]):
        probe = build_dspark(target.model, tokenizer=tok, **shape)
    shape.update(target_layer_ids=probe.target_layer_ids, mask_token_id=probe.mask_token_id)
    del probe
    S = shape["block_size"]
    gamma = dc.gamma if dc.gamma is not None else 1 + 3 * S / 8

    # ---- data: token ids + assistant loss mask; offline: plus the target's features and the fused layers' outputs
    layers = [i + 1 for i in shape["target_layer_ids"]]
    train_set, token_rows = training_data(cfg.data, target, accelerator, layers=layers,
                                          offline_hint=f" extra_layers=[{','.join(map(str, layers))}]")

    # ---- run identity and resume point (d2t/t2d reused as saved)
    record = run_record(cfg, "methods/dspark/train.py", target.identity, len(train_set), accelerator)
    resumed = resume_point(cfg, record, target.identity, accelerator)

    # ---- head: draft vocabulary from the checkpoint being continued, else the top-N assistant tokens
    kept = resumed.head_state if resumed else init[1] if init else None
    head = build_dspark(target.model, tokenizer=tok, **shape,
                        **vocab_maps(kept, d.vocab_size, target, token_rows, accelerator))
    if init is not None and resumed is None:
        head.load_state_dict(init[1])
    params = [p for p in head.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)

    # ---- the run: the head in fp32, optimizer and schedule, the checkpoint being continued, the held-out set
    run, eval_seqs = start(cfg, accelerator, target, head, params, len(train_set), record, resumed, init=init)
    memo = feature_memo(cfg, memo_features(run.head, teacher, keep_features=dc.loss == "kl"))
    micro_step = memo_step(run, memo, lambda batch: block_loss(run.head_ddp, run.head, teacher, batch, dc.anchors,
                                                               dc.loss, gamma, dc.confidence_alpha))

    def evaluate(head) -> dict:
        ev = block_acceptance(head.eval(), target, eval_seqs)
        head.train()
        return ev

    # ---- loop
    vocab = head.d2t.numel() if head.d2t is not None else target.identity["vocab_size"]
    accelerator.print(f"[train] dspark head {n_params / 1e6:.2f}M params, block {S} ({S} drafts per pass), "
                      f"{len(head.layers)} layers over target layers {head.target_layer_ids}, mask id "
                      f"{head.mask_token_id}, Markov rank {head.markov_rank}, confidence head "
                      f"{'on' if head.confidence_head is not None else 'off'}, draft vocab {vocab}, {dc.anchors} "
                      f"anchors/sequence, loss {dc.loss} (gamma {gamma:g}), {len(train_set)} sequences, "
                      f"{run.batches_per_epoch} batches/epoch/process, {run.total_steps} optimizer steps")
    train_loop(run, train_set, tok.pad_token_id or 0, micro_step, evaluate, postfix={"loss": "loss", "acc1": "acc_1"})

    # ---- save: resumable state, the held-out eval, the head folder and the single-file export
    training = {"recipe": "methods/dspark/train.py", "data": OmegaConf.to_container(cfg.data),
                "train": OmegaConf.to_container(tc), "dspark": OmegaConf.to_container(cfg.dspark),
                "gamma": gamma, "sequences": len(train_set)}
    return conclude(run, evaluate if eval_seqs else None, lambda ev: f"dspark block-{S} tau {ev['tau']:.3f}",
                    token_rows, target.identity, training,
                    {k: v for k, v in run.metrics.items() if k.startswith("acc_")})


def _target_side(head, target_model, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fused states [B, T, k*H], post-norm last states [B, T, H] or None, the target's greedy token after each
    position [B, T]) from the feature memo, offline features, or a target pass here (DFlash's recipe's sources)."""
    ids, attn = batch["input_ids"], batch["attention_mask"]
    if "states" in batch:  # online, from the feature memo
        states, last = batch["states"], batch.get("features")
    elif "features" in batch:  # offline: scripts/cache_features.py with extra_layers = ids + 1
        states = torch.cat([batch[f"layer_{i + 1}"] for i in head.target_layer_ids], dim=-1)
        last = batch["features"]
    else:  # online: the frozen target runs here, without gradients
        out = target_model.get_decoder()(input_ids=ids, attention_mask=attn, output_hidden_states=True)
        states, last = head.target_states(out.hidden_states), out.last_hidden_state
    argmax = batch.get("target_argmax")
    if argmax is None:
        argmax = lm_logits(target_model, last.to(target_model.dtype)).argmax(-1)
    return states, last, argmax


def block_loss(head_ddp, head, target_model, batch: dict, anchors: int, loss: str, gamma: float,
               confidence_alpha: float = 1.0) -> tuple[torch.Tensor, dict]:
    """One micro-batch: anchors, the target's labels, every block in one head pass (see the module docstring)."""
    ids, attn, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    s = head.block_size
    with torch.no_grad():
        states, last, argmax = _target_side(head, target_model, batch)
        a, valid = sample_anchors(loss_mask, attn, s + 1, anchors)  # [B, N]: a + S is a real position
        b, n = a.shape
        slot_pos = (a[:, :, None] + torch.arange(s, device=ids.device)).view(b, -1)  # [B, N*S] slot k at a+k
        slot_pos = slot_pos.clamp(max=ids.shape[1] - 2)  # invalid blocks only can overflow
        greedy = argmax.gather(1, slot_pos).view(b, n, s)  # y_{a+k+1}: the target's token after slot k's position
        prev = torch.cat([ids.gather(1, a)[:, :, None], greedy[:, :, :-1]], dim=-1)  # [B, N, S]
        draft_vocab = head.draft_token_ids()
        if draft_vocab is None:
            inside, label = torch.ones_like(greedy, dtype=torch.bool), greedy
        else:
            t2d = head.t2d.to(ids.device)
            inside, label = t2d[greedy], (t2d.long().cumsum(0) - 1)[greedy].clamp(min=0)  # draft ids ascend
        answer = valid[:, :, None] & (loss_mask * attn).bool().gather(1, slot_pos + 1).view(b, n, s)  # [B, N, S]
        scored = (answer & inside).float()
        decay = torch.exp(-torch.arange(s, device=ids.device, dtype=torch.float) / gamma)  # [S]
        weight = scored * decay
        if loss == "kl":  # the target's distribution at a+k over the draft vocabulary [B, N*S, V_draft]
            p, _ = soft_labels(target_model, last.float(), draft_vocab, argmax)
            p = p.gather(1, slot_pos[:, :, None].expand(-1, -1, p.shape[-1])).view(b, n, s, -1)
    ctx = head.context(states)  # [B, T, H] (fc and hidden_norm train: outside the DDP call, like head.logits)
    hidden = head_ddp(ctx, ids, a, valid)  # [B, N, S, H]
    logits, conf = head.block_logits(hidden, prev)  # [B, N, S, V_draft], [B, N, S] (or None)
    logq = F.log_softmax(logits, dim=-1)
    nll = -logq.gather(-1, label[..., None])[..., 0] if loss == "ce" else -(p * logq).sum(-1)  # [B, N, S]
    total = (nll * weight).sum() / weight.sum().clamp(min=1e-6)
    with torch.no_grad():
        hit = (logq.argmax(-1) == label) & inside  # [B, N, S]: the slot's greedy draft is the target's token
        per_k = (hit.float() * scored).sum((0, 1)) / scored.sum((0, 1)).clamp(min=1.0)  # [S]
    stats = {"acc": float((hit.float() * scored).sum() / scored.sum().clamp(min=1.0)), "blocks": int(valid.sum()),
             **{f"acc_{k + 1}": round(float(v), 4) for k, v in enumerate(per_k)}}
    if conf is not None and confidence_alpha > 0:
        conf_weight = answer.float() * decay
        bce = F.binary_cross_entropy_with_logits(conf, hit.float(), reduction="none")
        conf_loss = (bce * conf_weight).sum() / conf_weight.sum().clamp(min=1e-6)
        stats["conf_loss"] = conf_loss.item()
        total = total + confidence_alpha * conf_loss
    return total, {"loss": total.item(), **stats}


if __name__ == "__main__":
    main()
