"""What the frozen target tells a head that reads fused aux layers (EAGLE-3's and P-EAGLE's recipes): the feature
memo's per-sequence compute, and a micro-batch's inputs and soft labels."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from selfspec.data.features import full_argmax
from selfspec.train.features import soft_labels


def memo_features(head, target_model):
    """FeatureMemo's compute for EAGLE-3: one sequence's fused aux states `aux` [n, 3H], post-norm last hidden
    states `features` [n, H] and the target's full-vocabulary argmax `target_argmax` [n] (full_argmax)."""

    def compute(ids: torch.Tensor) -> dict[str, torch.Tensor]:
        out = target_model.get_decoder()(input_ids=ids, output_hidden_states=True)
        last = out.last_hidden_state[0].to(torch.bfloat16)
        return {"aux": head.aux_states(out.hidden_states)[0], "features": last,
                "target_argmax": full_argmax(target_model, last)}

    return compute


@torch.no_grad()
def teacher_signals(head, target_model, batch: dict) -> tuple[torch.Tensor, ...]:
    """What the frozen target says about a micro-batch: the fused aux states [B, T, k*H] the head reads, the target's
    distribution over the draft vocabulary p [B, T, V_draft] (the token after each position), whether the target's
    argmax lies in the draft vocabulary `inside` [B, T], and `valid` [B, T]: assistant tokens of real positions.
    From the feature memo, the offline feature files, or the target run here."""
    ids, attn, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    if "aux" in batch:  # online, from the feature memo
        aux, last = batch["aux"], batch["features"]
    elif "features" in batch:  # offline: precomputed by scripts/cache_features.py (extra_layers=aux layers)
        aux = torch.cat([batch[f"layer_{k}"] for k in head.aux_layers], dim=-1).float()
        last = batch["features"].float()
    else:  # online: the frozen target runs here, without gradients
        out = target_model.get_decoder()(input_ids=ids, attention_mask=attn, output_hidden_states=True)
        # [B, T, 3H], [B, T, H]
        aux, last = head.aux_states(out.hidden_states).float(), out.last_hidden_state.float()
    # [B, T, V_draft], [B, T]; the memo's argmax spares the full lm_head
    p, inside = soft_labels(target_model, last, head.draft_token_ids(), batch.get("target_argmax"))
    return aux, p, inside, (loss_mask * attn).float()


def masked_soft_ce(logits: torch.Tensor, p: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Soft cross-entropy of draft `logits` [B, n, V_draft] against the target's distribution `p` [B, n, V_draft],
    averaged over the positions `mask` [B, n] keeps; and the draft's top-1 agreement with p's there."""
    logq = F.log_softmax(logits.float(), dim=-1)
    denom = mask.sum().clamp(min=1.0)
    ce = (-(p * logq).sum(-1) * mask).sum() / denom
    acc = ((logq.argmax(-1) == p.argmax(-1)).float() * mask).sum() / denom
    return ce, acc.item()
