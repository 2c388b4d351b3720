"""P-EAGLE head (parallel EAGLE-3; arXiv 2602.01469, vLLM's `parallel_drafting`): an EAGLE-3 head (eagle3/head.py:
fused aux layers, Llama layers, a reduced draft vocabulary) that drafts K tokens in ONE forward pass.

One draft pass over [anchor pair, K-1 mask slots], causal, one KV cache (what vLLM's parallel drafter feeds):

    anchor  (fc(aux_n), x_{n+1})                 at position n      -> its output predicts x_{n+2}     (depth 1)
    slot i  (fc(mask_hidden), mask_token_id)     at position n + i  -> its output predicts x_{n+2+i}   (depth i+1)

A slot takes no drafted token and no earlier output, so every depth comes out of the same pass. Decoding feeds the
pairs the target has just verified as the anchors (methods/peagle/drafter.py): the pass that reads them also
drafts. `mask_hidden` [k*H] is learned (vLLM loads it by that name and applies fc to it); `mask_token_id` is an
existing embedding row (heads.dflash.default_mask_token_id picks it, as for DFlash). `depth` is the K trained for.

Training (methods/peagle/train.py) runs every anchor t of a sequence at once: `parallel_layout` appends, for each depth
d = 1..K-1, slots for a subset S_d of the anchors (conditional drop-token sampling, COD: S_d within S_{d-1}), with
the mask of unrolled drafting: slot (t, d) attends to the real pairs u <= t and to its own chain's slots d' <= d.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from torch import nn

from selfspec.core.errors import UserError
from selfspec.methods.eagle3.head import Eagle3Head, aux_and_vocab, finish
from selfspec.methods.eagle3.head import default_aux_layers as default_aux_layers  # the recipe's, as EAGLE-3's
from selfspec.registry import method

BASE = "eagle3"  # the method P-EAGLE builds on: its head class, its export layouts, the heads it warm-starts from

MAX_DEPTH = method("peagle").most("depth")  # drafts per pass: what a record may state (registry.py)


@dataclass
class PEagleConfig:
    """Schema of `draft=peagle` (Hydra group `draft/`)."""

    type: str = field(default="peagle", metadata={"help": "head type recorded in checkpoints (set by draft=peagle)"})
    aux_layers: Optional[list[int]] = field(default=None, metadata={"help": (
        "Target layers whose un-normed outputs are fused, as EAGLE-3's (null = {2, L//2, L-3}, clamped)")})
    vocab_size: Optional[int] = field(default=8192, metadata={"help": (
        "Draft vocabulary: the N most frequent assistant tokens of the training data (null = the full vocabulary)")})
    num_layers: int = field(default=1, metadata={"help": (
        "Llama decoder layers (1-4): the first reads cat(embedding, hidden) as EAGLE-3's, the others stack on it")})
    depth: int = field(default=5, metadata={"help": (
        "K: tokens one draft pass proposes (the anchor's and K-1 mask slots'); decoding may verify fewer")})
    mask_token_id: Optional[int] = field(default=None, metadata={"help": (
        "Input id of the mask slots, an existing embedding row; null = automatic (heads.dflash."
        "default_mask_token_id: a spare row, else a special token chat data never produces)")})
    init_from: Optional[str] = field(default=None, metadata={"help": (
        "Warm start: an EAGLE-3 head (its fc, first layer, norm, lm_head and d2t/t2d; the other layers and "
        "mask_hidden start fresh) or a peagle head (all of it). null = a fresh head.")})


class PEagleHead(Eagle3Head):
    head_type = "peagle"

    def __init__(self, target_config, aux_layers: Sequence[int], d2t: torch.Tensor, t2d: torch.Tensor,
                 num_layers: int = 1, depth: int = 5, mask_token_id: int = 0):
        super().__init__(target_config, aux_layers, d2t, t2d, layer="llama", num_layers=num_layers)
        self.depth, self.mask_token_id = int(depth), int(mask_token_id)
        # the mask slots' input before fc, as vLLM keeps it ([k*H]; it loads `mask_hidden` [1, k*H] or [k*H])
        self.mask_hidden = nn.Parameter(torch.randn(self.fc.in_features) * self.config.initializer_range)

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                past_key_values=None, attention_mask: Optional[torch.Tensor] = None,
                masked: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Eagle3Head.forward over aux-width inputs [B, T, k*H]; where `masked` [B, T] is True the input is a mask
        slot (mask_hidden, mask_token_id), whatever `hidden` and `input_ids` hold there."""
        if masked is not None:
            hidden = torch.where(masked[..., None], self.mask_hidden.to(hidden.dtype), hidden)
            input_ids = torch.where(masked, torch.full_like(input_ids, self.mask_token_id), input_ids)
        return super().forward(hidden, input_ids, position_ids, past_key_values, attention_mask)

    def head_config(self) -> dict:
        return {"type": self.head_type, "aux_layers": list(self.aux_layers), "vocab_size": int(self.d2t.numel()),
                "layer": "llama", "num_layers": len(self.layers), "depth": self.depth,
                "mask_token_id": self.mask_token_id}


def parallel_layout(anchors: Sequence[torch.Tensor], attention_mask: torch.Tensor) -> dict:
    """Inputs of one training (or held-out) pass over T real pairs plus, for each depth d = 1..len(anchors), a mask
    slot per anchor position in anchors[d-1] (each within the one before: a slot needs its chain's earlier slots).

    -> position_ids [B, N] (real t: t; slot (t, d): t + d), attention_mask [B, 1, N, N] bool (True = attend: real
    rows causal; slot (t, d) sees real u <= t and slots (t, d' <= d)), masked [B, N] (True for the N - T slots),
    sizes [T, |S_1|, ...] to split the output by depth. Padded real keys (attention_mask 0) are never attended."""
    b, t = attention_mask.shape
    device = attention_mask.device
    anchor = torch.cat([torch.arange(t, device=device), *[a.to(device) for a in anchors]])  # [N]
    depth = torch.cat([torch.zeros(t, dtype=torch.long, device=device),
                       *[torch.full((len(a),), d, dtype=torch.long, device=device) for d, a in enumerate(anchors, 1)]])
    q_anchor, k_anchor, q_depth, k_depth = anchor[:, None], anchor[None], depth[:, None], depth[None]
    real = (k_depth == 0) & (k_anchor <= q_anchor)
    own_chain = (k_depth > 0) & (k_anchor == q_anchor) & (k_depth <= q_depth)
    allowed = real | own_chain  # [N, N]
    n = anchor.numel()
    keys = torch.cat([attention_mask.bool(), torch.ones(b, n - t, dtype=torch.bool, device=device)], dim=1)
    return {"position_ids": (anchor + depth)[None].expand(b, -1),
            "attention_mask": allowed[None, None] & keys[:, None, None],
            "masked": (depth > 0)[None].expand(b, -1), "sizes": [t, *[len(a) for a in anchors]]}


def run_parallel(module, aux: torch.Tensor, next_ids: torch.Tensor, attention_mask: torch.Tensor,
                 anchors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`module` (the head, or its DDP/FSDP wrapper) over parallel_layout's pass: aux [B, T, k*H] and next_ids [B, T]
    (x_{t+1} beside aux_t) -> outputs per depth: [B, T, H] for the real pairs (depth 1), [B, |S_d|, H] for depth d+1."""
    from transformers import DynamicCache

    lay = parallel_layout(anchors, attention_mask)
    extra = lay["masked"].shape[1] - aux.shape[1]
    hidden = torch.cat([aux, aux.new_zeros(aux.shape[0], extra, aux.shape[2])], dim=1)
    ids = torch.cat([next_ids, next_ids.new_zeros(next_ids.shape[0], extra)], dim=1)
    out = module(hidden, ids, lay["position_ids"], past_key_values=DynamicCache(),
                 attention_mask=lay["attention_mask"], masked=lay["masked"])
    return list(out.split(lay["sizes"], dim=1))


def cod_anchors(t: int, depth: int, ratio: float, ratio_min: float, device=None) -> list[torch.Tensor]:
    """Conditional drop-token sampling: anchors of depths 1..depth-1, depth d keeping ceil(t * max(ratio^d,
    ratio_min)) positions drawn (torch's RNG: a resumed run draws the same) from those of depth d-1, sorted."""
    kept = torch.arange(t, device=device)
    out = []
    for d in range(1, depth):
        n = min(kept.numel(), max(1, math.ceil(round(t * max(ratio ** d, ratio_min), 6))))  # 10 * 0.3 is 3, not 4
        kept = kept[torch.randperm(kept.numel(), device=device)[:n]].sort().values
        out.append(kept)
    return out


def build_peagle(target_model, aux_layers: Optional[Sequence[int]] = None, vocab_size: Optional[int] = None,
                 draft_vocab: Optional[torch.Tensor] = None, d2t: Optional[torch.Tensor] = None,
                 t2d: Optional[torch.Tensor] = None, num_layers: int = 1, depth: int = 5,
                 mask_token_id: Optional[int] = None, tokenizer=None, layer: str = "llama", **_unused) -> PEagleHead:
    """A P-EAGLE head for `target_model` (the vocabulary as build_eagle3's). mask_token_id None: chosen from the
    tokenizer (heads.dflash.default_mask_token_id), else the last embedding row."""
    from selfspec.methods.dflash.head import default_mask_token_id

    if layer != "llama":
        raise UserError(f"a peagle head is Llama layers (what vLLM's parallel drafter loads), not layer={layer}")
    for key, value, low, high in (("num_layers", num_layers, 1, 8), ("depth", depth, 2, MAX_DEPTH)):
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise UserError(f"peagle {key} must be an integer in [{low}, {high}] (got {value!r})")
    aux, d2t, t2d = aux_and_vocab(target_model, aux_layers, vocab_size, draft_vocab, d2t, t2d)
    rows = target_model.get_input_embeddings().weight.shape[0]
    if mask_token_id is None:
        mask_token_id = default_mask_token_id(tokenizer, rows) if tokenizer is not None else rows - 1
    if isinstance(mask_token_id, bool) or not isinstance(mask_token_id, int) or not 0 <= mask_token_id < rows:
        raise UserError(f"peagle mask_token_id={mask_token_id} is outside the target's embedding rows [0, {rows})")
    head = PEagleHead(target_model.config, aux, d2t, t2d, num_layers=num_layers, depth=depth,
                      mask_token_id=mask_token_id)
    return finish(head, target_model)
