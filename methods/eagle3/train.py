"""Train an EAGLE-3 head with a training-time test: `accelerate launch methods/eagle3/train.py [overrides]`.

Reads top to bottom: config -> accelerator -> frozen target -> data -> head -> optimizer -> loop -> save.

Training-time test (TTT): every position t starts a draft chain that is unrolled `ttt.steps` times, exactly
as decoding rolls it out (all T chains at once, one head pass per step, one KV cache):
    step 0: input (fc(aux_t), x_{t+1}) at RoPE position t; attends to step-0 keys u <= t
    step j: input (h_t^{j-1}, x_{t+1+j}) at position t+j; attends to step-0 keys u <= t and chain t's keys of
            steps 1..j (eval/acceptance.rollout_mask); x_{t+1+j} is the data token (teacher forcing, as SpecForge)
    loss j: soft CE between the head's q(. | h_t^j) and the target's distribution at position t+1+j restricted
            to the draft vocabulary, on positions whose predicted token x_{t+j+2} is an assistant token and whose
            target argmax the draft vocabulary holds; weight decay^j (0.8^j), no feature loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from omegaconf import OmegaConf

from selfspec.core.cli import entry, read_once
from selfspec.heads.layers import check_layer, recorded_layer
from selfspec.methods.eagle3.head import build_eagle3, default_aux_layers
from selfspec.core.errors import UserError
from selfspec.eval.acceptance import aux_features, chain_acceptance
from selfspec.train.aux_teacher import masked_soft_ce, memo_features, teacher_signals
from selfspec.train.config import RunConfig, draft_schemas
from selfspec.train.features import feature_model, training_data
from selfspec.train.loop import conclude, memo_step, train_loop
from selfspec.train.preamble import feature_memo, head_to_continue, open_run, start, vocab_maps
from selfspec.train.run import UNREAD, resume_point, run_record
from selfspec.train.rollout import TTTConfig, shift, ttt_unroll

# the shared train: schema's loss knobs of before issue 51, which this recipe never read, and ttt.on_policy (refused
# unless false): dropped from an old run's record (train/run.py old_keys)
OLD_KEYS = {**UNREAD, "ttt.on_policy": None}


@dataclass
class TrainEagle3Config(RunConfig):
    ttt: TTTConfig = field(default_factory=TTTConfig)


@entry("train_eagle3", TrainEagle3Config, draft_schemas())
def main(cfg) -> dict:
    if cfg.draft.type != "eagle3":
        raise UserError(f"methods/eagle3/train.py trains draft=eagle3 heads, not '{cfg.draft.type}'")
    ttt = read_once(cfg.ttt, TTTConfig)  # read once: the loss reads it every micro-step
    if ttt.steps < 1:
        raise UserError(f"ttt.steps must be >= 1, not {ttt.steps}")
    tc, d = cfg.train, cfg.draft
    accelerator, target = open_run(cfg)  # output_dir taken, torch seeded, the frozen target on the device
    tok = target.tokenizer
    teacher = feature_model(target.model, tc.features_dtype)  # the target (or its bf16 copy) making features

    # ---- a head to fine-tune: its aux layers and its d2t/t2d are kept, never rebuilt from the new data
    init = head_to_continue(d.init_from, "draft.init_from", "eagle3", target)  # (record, state) or None
    n_layers = target.identity["num_hidden_layers"]
    layer = recorded_layer(init[0]["head"]) if init else check_layer(d.layer)  # a fine-tuned head keeps its own
    if init:
        aux_layers = list(init[0]["head"]["aux_layers"])
    else:
        aux_layers = list(d.aux_layers) if d.aux_layers is not None else default_aux_layers(n_layers)
    if not aux_layers or any(not 0 <= k < n_layers for k in aux_layers):
        raise UserError(f"draft.aux_layers={list(aux_layers)}: each must be a target layer id in [0, {n_layers - 1}] "
                        f"(HF hidden_states[k], the un-normed residual stream after k layers)")

    # ---- data: token ids + assistant loss mask; offline: plus the target's features and aux layers
    train_set, token_rows = training_data(cfg.data, target, accelerator, layers=aux_layers)

    # ---- run identity (what shapes the result: output_dir/run.json) and resume point (d2t/t2d reused as saved)
    record = run_record(cfg, "methods/eagle3/train.py", target.identity, len(train_set), accelerator)
    resumed = resume_point(cfg, record, target.identity, accelerator)

    # ---- head: draft vocabulary from the checkpoint being continued, else the top-N assistant tokens
    kept = resumed.head_state if resumed else init[1] if init else None
    head = build_eagle3(target.model, aux_layers=aux_layers, layer=layer,
                        **vocab_maps(kept, d.vocab_size, target, token_rows, accelerator))
    if init is not None and resumed is None:
        head.load_state_dict(init[1])
    params = [p for p in head.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)

    # ---- the run: the head in fp32, optimizer and schedule, the checkpoint being continued, the held-out set
    # (prompts continued by the target's own greedy decoding), the trackers
    run, eval_seqs = start(cfg, accelerator, target, head, params, len(train_set), record, resumed, init=init)

    # after a sequence's first use its aux/last features and the target's argmax come from RAM, not the target
    memo = feature_memo(cfg, memo_features(run.head, teacher))

    micro_step = memo_step(run, memo, lambda batch: ttt_loss(run.head_ddp, run.head, teacher, batch, ttt))

    def evaluate(head) -> dict:
        ev = chain_acceptance(head.eval(), target, eval_seqs, tc.eval_depth, features=aux_features(head, target.model))
        head.train()
        return ev

    # ---- loop
    accelerator.print(f"[train] eagle3 head {n_params / 1e6:.2f}M params, aux layers {aux_layers}, draft vocab "
                      f"{head.d2t.numel()}, TTT {ttt.steps} steps, {len(train_set)} sequences, "
                      f"{run.batches_per_epoch} batches/epoch/process, {run.total_steps} optimizer steps")
    train_loop(run, train_set, tok.pad_token_id or 0, micro_step, evaluate, postfix={"loss": "loss", "acc0": "acc_0"})

    # ---- save: resumable state, the held-out eval, the head folder and the single-file export
    training = {"recipe": "methods/eagle3/train.py", "data": OmegaConf.to_container(cfg.data),
                "train": OmegaConf.to_container(tc), "ttt": OmegaConf.to_container(cfg.ttt),
                "init_from": d.init_from, "sequences": len(train_set)}
    return conclude(run, evaluate if eval_seqs else None, lambda ev: f"chain-{tc.eval_depth} tau {ev['tau']:.3f}",
                    token_rows, target.identity, training,
                    {k: v for k, v in run.metrics.items() if k.startswith("acc_")})


def ttt_loss(head_ddp, head, target_model, batch: dict, ttt: TTTConfig) -> tuple[torch.Tensor, dict]:
    """One micro-batch: unroll `ttt.steps` draft steps from every position (see the module docstring)."""
    ids, attn = batch["input_ids"], batch["attention_mask"]
    aux, p, inside, valid = teacher_signals(head, target_model, batch)
    loss = torch.zeros((), device=ids.device)
    stats = {}
    for j, hidden in enumerate(ttt_unroll(head_ddp, aux, ids, attn, ttt.steps)):
        # the output predicts x_{t+j+2}: the target's distribution at t+1+j
        ce, acc = masked_soft_ce(head.logits(hidden), shift(p, 1 + j), shift(valid, 2 + j) * shift(inside, 1 + j))
        loss = loss + ttt.decay ** j * ce
        stats[f"ce_{j}"], stats[f"acc_{j}"] = ce.item(), acc
    stats["loss"] = loss.item()
    return loss, stats


if __name__ == "__main__":
    main()
