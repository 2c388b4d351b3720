"""Train a DFlash block drafter on a frozen target: `accelerate launch methods/dflash/train.py [overrides]`.

Reads top to bottom: config -> accelerator -> frozen target -> data -> head -> optimizer -> loop -> save.

Each sequence gets `dflash.anchors` random anchors a (assistant tokens whose block fits in the sequence: a + S-1 is
a real position). Block a = [x_a, MASK x (S-1)] sees the target's fused context at positions u < a and itself
(dflash/head.py's training call, all blocks of a batch in one pass). Block position k (1..S-1) predicts token a+k:
    label  y_{a+k} = argmax of the target's logits at position a+k-1 (its greedy token, NOT the data token)
    loss   ce: -log q_k(y_{a+k});  kl: soft CE against the target's distribution there, over the draft vocabulary
    weight w_k = exp(-(k-1)/gamma) (DFlash's position decay: a late draft only counts if every earlier one was
           accepted), loss = sum(w * l * m) / sum(w * m)
    m      1 where token a+k is an assistant token and y_{a+k} is in the draft vocabulary (else never acceptable)
No input noise: the context comes from the target as decoding sees it. Held-out eval: acceptance.py's
block_acceptance (one block of S at every position of the target's greedy continuations).
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
from selfspec.data.features import full_argmax
from selfspec.methods.dflash.acceptance import block_acceptance
from selfspec.methods.dflash.head import build_dflash
from selfspec.train.config import RunConfig, draft_schemas
from selfspec.train.features import feature_model, soft_labels, training_data
from selfspec.train.loop import conclude, memo_step, train_loop
from selfspec.train.preamble import feature_memo, head_to_continue, open_run, start, vocab_maps
from selfspec.train.run import UNREAD, resume_point, run_record

LOSSES = ("ce", "kl")

# the shared train: schema's loss knobs of before issue 51, which this recipe never read (train/run.py old_keys)
OLD_KEYS = UNREAD


@dataclass
class DFlashTrainConfig:
    """The DFlash loss (`dflash.*`); the head's shape is `draft.*` (methods/dflash/conf/draft/dflash.yaml)."""

    anchors: int = field(default=64, metadata={"help": (
        "Blocks per sequence: random anchors among its assistant tokens whose block fits (anchor + S-1 a real "
        "position); fewer when the sequence has fewer. z-lab trains ~512 per sequence on GPUs; 64 keeps a step "
        "cheap on a CPU (the target's pass, not the blocks, is then the main cost).")})
    loss: str = field(default="ce", metadata={"help": (
        "ce: cross-entropy against the target's greedy token at each block position (argmax of its logits, not the "
        "data token; speculators' ce; SpecForge scores the data token, the same on data the target wrote itself); "
        "kl: soft cross-entropy (KL up to a constant) against the target's distribution there, restricted to the "
        "draft vocabulary (speculators' KL option).")})
    gamma: Optional[float] = field(default=None, metadata={"help": (
        "Position decay: block position k (1..S-1) weighs exp(-(k-1)/gamma). null = 1 + 3*S/8, which gives the "
        "paper's 7 for S=16 and 4 for S=8.")})
    init_from: Optional[str] = field(default=None, metadata={"help": (
        "A dflash head to fine-tune: its weights, shape (block size, layers, target layer ids, mask id) and its "
        "d2t/t2d (never rebuilt) are the start; draft.* then only has to name draft=dflash.")})


@dataclass
class TrainDFlashConfig(RunConfig):
    dflash: DFlashTrainConfig = field(default_factory=DFlashTrainConfig)


@entry("train_dflash", TrainDFlashConfig, draft_schemas())
def main(cfg) -> dict:
    # dflash.* read once, as its schema's values: the loss closure uses them every micro-step
    d, dc, tc = cfg.draft, read_once(cfg.dflash, DFlashTrainConfig), cfg.train
    if d.type != "dflash":
        raise UserError(f"methods/dflash/train.py trains draft=dflash heads, not '{d.type}'")
    if dc.anchors < 1:
        raise UserError(f"dflash.anchors must be >= 1, not {dc.anchors}")
    if dc.loss not in LOSSES:
        raise UserError(f"dflash.loss={dc.loss!r}: use ce (the target's greedy tokens) or kl (its distribution)")
    if dc.gamma is not None and not dc.gamma > 0:
        raise UserError(f"dflash.gamma must be > 0 (or null: derived from the block size), not {dc.gamma}")
    accelerator, target = open_run(cfg)  # output_dir taken, torch seeded, the frozen target on the device
    tok = target.tokenizer
    teacher = feature_model(target.model, tc.features_dtype)  # the target (or its bf16 copy) making features

    # ---- the head's shape: a head to fine-tune keeps its own; checked (one line) before any data is read by
    # building it once, outside the seeded RNG stream (the head trained is built below, with its vocabulary)
    init = head_to_continue(dc.init_from, "dflash.init_from", "dflash", target)  # (record, state) or None
    if init:
        shape = {k: v for k, v in init[0]["head"].items() if k not in ("type", "vocab_size")}
    else:
        shape = {"block_size": d.block_size, "num_layers": d.num_layers, "mask_token_id": d.mask_token_id,
                 "target_layer_ids": None if d.target_layer_ids is None else list(d.target_layer_ids)}
    with torch.random.fork_rng(devices=[]):
        probe = build_dflash(target.model, tokenizer=tok, **shape)
    shape.update(target_layer_ids=probe.target_layer_ids, mask_token_id=probe.mask_token_id)
    del probe
    S = shape["block_size"]
    gamma = dc.gamma if dc.gamma is not None else 1 + 3 * S / 8

    # ---- data: token ids + assistant loss mask; offline: plus the target's features and the fused layers' outputs
    # (layer id i is hidden_states[i + 1])
    layers = [i + 1 for i in shape["target_layer_ids"]]
    train_set, token_rows = training_data(cfg.data, target, accelerator, layers=layers,
                                          offline_hint=f" extra_layers=[{','.join(map(str, layers))}]")

    # ---- run identity (what shapes the result: output_dir/run.json) and resume point (d2t/t2d reused as saved)
    record = run_record(cfg, "methods/dflash/train.py", target.identity, len(train_set), accelerator)
    resumed = resume_point(cfg, record, target.identity, accelerator)

    # ---- head: draft vocabulary from the checkpoint being continued, else the top-N assistant tokens
    kept = resumed.head_state if resumed else init[1] if init else None
    head = build_dflash(target.model, tokenizer=tok, **shape,
                        **vocab_maps(kept, d.vocab_size, target, token_rows, accelerator))
    if init is not None and resumed is None:
        head.load_state_dict(init[1])
    params = [p for p in head.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)

    # ---- the run: the head in fp32, optimizer and schedule, the checkpoint being continued, the held-out set
    # (prompts continued by the target's own greedy decoding), the trackers
    run, eval_seqs = start(cfg, accelerator, target, head, params, len(train_set), record, resumed, init=init)

    # after a sequence's first use its fused states, the target's argmax (and for kl its features) come from RAM
    memo = feature_memo(cfg, memo_features(run.head, teacher, keep_features=dc.loss == "kl"))

    micro_step = memo_step(run, memo, lambda batch: block_loss(run.head_ddp, run.head, teacher, batch, dc.anchors,
                                                               dc.loss, gamma))

    def evaluate(head) -> dict:
        ev = block_acceptance(head.eval(), target, eval_seqs)
        head.train()
        return ev

    # ---- loop
    vocab = head.d2t.numel() if head.d2t is not None else target.identity["vocab_size"]
    accelerator.print(f"[train] dflash head {n_params / 1e6:.2f}M params, block {S}, {len(head.layers)} layers over "
                      f"target layers {head.target_layer_ids}, mask id {head.mask_token_id}, draft vocab {vocab}, "
                      f"{dc.anchors} anchors/sequence, loss {dc.loss} (gamma {gamma:g}), {len(train_set)} sequences, "
                      f"{run.batches_per_epoch} batches/epoch/process, {run.total_steps} optimizer steps")
    train_loop(run, train_set, tok.pad_token_id or 0, micro_step, evaluate, postfix={"loss": "loss", "acc1": "acc_1"})

    # ---- save: resumable state, the held-out eval, the head folder and the single-file export
    training = {"recipe": "methods/dflash/train.py", "data": OmegaConf.to_container(cfg.data),
                "train": OmegaConf.to_container(tc), "dflash": OmegaConf.to_container(cfg.dflash),
                "gamma": gamma, "sequences": len(train_set)}
    return conclude(run, evaluate if eval_seqs else None, lambda ev: f"block-{S} tau {ev['tau']:.3f}", token_rows,
                    target.identity, training, {k: v for k, v in run.metrics.items() if k.startswith("acc_")})


def memo_features(head, target_model, keep_features: bool):
    """FeatureMemo's compute for DFlash: one sequence's fused target states `states` [n, k*H], the target's
    full-vocabulary argmax `target_argmax` [n] (full_argmax) and, for the kl loss, its post-norm last hidden
    states `features` [n, H] (the distribution is recomputed from them over the draft rows only)."""

    def compute(ids: torch.Tensor) -> dict[str, torch.Tensor]:
        out = target_model.get_decoder()(input_ids=ids, output_hidden_states=True)
        last = out.last_hidden_state[0].to(torch.bfloat16)
        row = {"states": head.target_states(out.hidden_states)[0], "target_argmax": full_argmax(target_model, last)}
        return {**row, "features": last} if keep_features else row

    return compute


def sample_anchors(loss_mask: torch.Tensor, attention_mask: torch.Tensor, block_size: int,
                   n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `n` distinct random anchors per sequence -> (anchors [B, N] long, ascending, valid [B, N] bool).

    A position a may anchor a block iff token a is an assistant token and a + block_size - 1 is a real position
    (right padding: a + S-1 < the sequence's length), so every label position lies inside the sequence. Sequences
    with fewer such positions get them all; their other slots are invalid (anchor 0). Draws from torch's RNG on
    the masks' device (restored on resume: train/loop.restore)."""
    b, t = attention_mask.shape
    lengths = attention_mask.sum(-1, keepdim=True)  # [B, 1]
    pos = torch.arange(t, device=attention_mask.device)[None]
    ok = (loss_mask * attention_mask).bool() & (pos + block_size - 1 < lengths)  # [B, T]
    k = min(n, t)
    order = torch.where(ok, torch.rand(b, t, device=ok.device), 2.0).argsort(dim=1)[:, :k]  # allowed ones first
    valid = ok.gather(1, order)
    key = torch.where(valid, order, t + order)  # ascending anchors, the invalid slots after them
    order = order.gather(1, key.argsort(dim=1))
    valid = ok.gather(1, order)
    return torch.where(valid, order, 0), valid


def block_loss(head_ddp, head, target_model, batch: dict, anchors: int, loss: str,
               gamma: float) -> tuple[torch.Tensor, dict]:
    """One micro-batch: anchors, the target's labels, every block in one head pass (see the module docstring)."""
    ids, attn, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    s = head.block_size
    with torch.no_grad():
        if "states" in batch:  # online, from the feature memo
            states, last = batch["states"], batch.get("features")
        elif "features" in batch:  # offline: scripts/cache_features.py with extra_layers = ids + 1
            states = torch.cat([batch[f"layer_{i + 1}"] for i in head.target_layer_ids], dim=-1)
            last = batch["features"]
        else:  # online: the frozen target runs here, without gradients
            out = target_model.get_decoder()(input_ids=ids, attention_mask=attn, output_hidden_states=True)
            states, last = head.target_states(out.hidden_states), out.last_hidden_state  # [B, T, k*H], [B, T, H]
        argmax = batch.get("target_argmax")  # [B, T]: the target's greedy token after each position
        if argmax is None:
            argmax = lm_logits(target_model, last.to(target_model.dtype)).argmax(-1)
        a, valid = sample_anchors(loss_mask, attn, s, anchors)  # [B, N]
        b, n = a.shape
        label_pos = a[:, :, None] + torch.arange(1, s, device=ids.device)  # [B, N, S-1] token a+k
        label_pos = label_pos.clamp(max=ids.shape[1] - 1).view(b, -1)  # invalid blocks only can overflow
        greedy = argmax.gather(1, label_pos - 1)  # [B, N*(S-1)] the target's token at a+k, predicted at a+k-1
        draft_vocab = head.draft_token_ids()
        if draft_vocab is None:
            inside, label = torch.ones_like(greedy, dtype=torch.bool), greedy
        else:
            t2d = head.t2d.to(ids.device)
            inside, label = t2d[greedy], (t2d.long().cumsum(0) - 1)[greedy].clamp(min=0)  # draft ids ascend
        scored = (valid[:, :, None] & (loss_mask * attn).bool().gather(1, label_pos).view(b, n, s - 1)
                  & inside.view(b, n, s - 1)).float()  # [B, N, S-1]
        k = torch.arange(1, s, device=ids.device, dtype=torch.float)
        weight = scored * torch.exp(-(k - 1) / gamma)  # [B, N, S-1]
        if loss == "kl":  # the target's distribution at a+k-1 over the draft vocabulary [B, N*(S-1), V_draft]
            p, _ = soft_labels(target_model, last.float(), draft_vocab, argmax)
            p = p.gather(1, (label_pos - 1)[:, :, None].expand(-1, -1, p.shape[-1]))
    ctx = head.context(states)  # [B, T, H] (fc and hidden_norm train: outside the DDP call, like head.logits)
    hidden = head_ddp(ctx, ids, a, valid)  # [B, N, S, H]
    logq = F.log_softmax(head.logits(hidden[:, :, 1:]).float(), dim=-1).view(b, n * (s - 1), -1)
    if loss == "ce":
        nll = -logq.gather(-1, label[:, :, None])[..., 0]
    else:
        nll = -(p * logq).sum(-1)
    nll = nll.view(b, n, s - 1)
    total = (nll * weight).sum() / weight.sum().clamp(min=1e-6)
    with torch.no_grad():
        hit = (logq.argmax(-1) == label).view(b, n, s - 1).float() * scored
        per_k = hit.sum((0, 1)) / scored.sum((0, 1)).clamp(min=1.0)  # [S-1]
    stats = {"loss": total.item(), "acc": (hit.sum() / scored.sum().clamp(min=1.0)).item(),
             "blocks": int(valid.sum()), **{f"acc_{j + 1}": round(float(v), 4) for j, v in enumerate(per_k)}}
    return total, stats


if __name__ == "__main__":
    main()
