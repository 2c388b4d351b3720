"""DSpark head (DeepSeek, arXiv 2607.05147): DFlash's block drafter plus a Markov head and a confidence head.

The body is DFlash's (methods/dflash/head.py: the fused target context, [anchor, MASK x (S-1)] through a few
non-causal layers at positions anchor .. anchor+S-1, the target's embedding and lm_head), read anchor-first
("sample from anchor"): block slot k, at position anchor + k, predicts token anchor + k + 1, so one pass proposes S
tokens (DFlash's slot 0 predicts nothing and a pass proposes S-1). Two small heads then make the block
semi-autoregressive and say how much of it to propose:

    h_k     = DFlash's pre-norm hidden state of slot k                  # [B, S, H]
    prev_k  = the token before slot k's: the anchor for k = 0, else the token drafted at slot k-1
    e_k     = markov_w1[prev_k]                                         # [B, S, r]   a row of [V_target, r]
    logit_k = lm_head(norm(h_k)) + markov_w2(e_k)                       # [B, S, V_draft], the Markov bias
    conf_k  = sigmoid(conf_proj(cat(norm(h_k), e_k)))                   # [B, S]  the chance slot k is accepted

The bias chains the block: slot k's distribution depends on the token drawn at slot k-1, so drafting walks the block
slot by slot (one cheap [r] -> [V_draft] product per slot after the single DFlash pass). These are llama.cpp
11434's DSpark graph (src/models/dflash.cpp build_dspark_markov_head: w1 get_rows of the previous token, w2 mul_mat,
added to slot i's logits, the argmax chained to slot i+1; conf = sigmoid(conf_proj . [t_embd(i); w1[prev(i)]] + b)
with t_embd the post-norm hidden state) and speculators' `dspark` model (models/dspark/core.py, model_definitions.py:
MarkovHead "vanilla", ConfidenceHead with confidence_head_with_markov; markov_w1 indexes the verifier's vocabulary,
markov_w2 projects to the draft vocabulary).

State-dict names map 1:1 onto speculators / llama.cpp's converter (`markov_head.markov_w1.weight` [V_target, r],
`markov_head.markov_w2.weight` [V_draft, r], `confidence_head.proj.{weight [1, H + r], bias [1]}`; GGUF markov_w1,
markov_w2, conf_proj), beside DFlash's own names.

Training (one call scores N blocks of each sequence, as DFlash's):

    hidden = head(ctx, ids, anchors, valid)                    # [B, N, S, H]  (DFlash's forward)
    logits, conf = head.block_logits(hidden, prev)             # prev [B, N, S]: the anchor, then the labels of
                                                               # slots 0..S-2 (teacher forcing)

Decoding (the cache is DFlash's: committed positions only):

    hidden = head.block_hidden(x_n, n, cache)                  # [B, S, H], once per block
    base, normed = head.logits(hidden), head.norm(hidden)      # DFlash's logits of every slot, one lm_head pass
    logits, conf = head.chain_step(base[:, k], normed[:, k], prev)   # slot k once the token before it is drawn
                                                               # (prev: x_n at k = 0, else the token drawn at k-1)

Engines differ in one place: llama.cpp adds the bias to the lm_head's raw output (dflash.cpp: "DFlash1 and DSpark
read them through the sampler"), here it is added after the target family's own logit processing
(core.target.finish_logits), as DFlash's draft logits are; the two agree for every family without logit scaling or
soft-capping, and a draft's distribution never changes what verification commits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from torch import nn

from selfspec.core.errors import UserError
from selfspec.methods.dflash.head import DFlashConfig, DFlashHead, dflash_options
from selfspec.registry import method

MAX_BLOCK_SIZE, MAX_MARKOV_RANK = method("dspark").most("block_size"), method("dspark").most("markov_rank")


@dataclass
class DSparkConfig(DFlashConfig):
    """Schema of `draft=dspark` (Hydra group `draft/`): DFlash's options, read anchor-first, and the two heads'."""

    type: str = field(default="dspark", metadata={"help": "head type recorded in checkpoints (set by draft=dspark)"})
    block_size: int = field(default=8, metadata={"help": (
        "S: block positions, the anchor (last committed token) plus S-1 mask positions; every one of them predicts "
        "the token after it, so one draft pass proposes S tokens (DFlash's: S-1). In [2, 64]; speculators' "
        "default 8.")})
    markov_rank: int = field(default=64, metadata={"help": (
        "r: rank of the Markov bias markov_w2(markov_w1[previous token]), [V_target, r] + [V_draft, r] weights. "
        "speculators' default is 256; 64 keeps SmolLM2's 49k-token tables at 6M parameters for a CPU.")})
    confidence_head: bool = field(default=True, metadata={"help": (
        "A linear head over (post-norm hidden, markov_w1[previous token]) predicting each slot's acceptance: the "
        "drafter's min_confidence cuts the block where the product of these falls below it. false = none (then "
        "min_confidence uses the drafted tokens' own probabilities, as DFlash's).")})


class MarkovHead(nn.Module):
    """bias(prev) = markov_w2(markov_w1[prev]): a low-rank [V_target, V_draft] table of next-token logit offsets."""

    def __init__(self, target_vocab: int, draft_vocab: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(target_vocab, rank)  # [V_target, r]: the previous token is a target id
        self.markov_w2 = nn.Linear(rank, draft_vocab, bias=False)  # [V_draft, r]

    def forward(self, prev: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(self.markov_w1(prev))


class ConfidenceHead(nn.Module):
    """logit(accepted) = proj(cat(norm(h), markov_w1[prev])) -> [...]."""

    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features)[..., 0]


class DSparkHead(DFlashHead):
    head_type = "dspark"
    # besides forward, training calls these on the head's own weights (train/loop.start_run gathers them under FSDP;
    # block_logits runs logits and norm inside, so they are not listed again: a nested gather would reshard early)
    forward_methods = ("context", "block_logits")

    def __init__(self, target_config, block_size: int, num_layers: int, target_layer_ids: Sequence[int],
                 mask_token_id: int, target_vocab: int, markov_rank: int, confidence_head: bool = True,
                 d2t: Optional[torch.Tensor] = None, t2d: Optional[torch.Tensor] = None):
        super().__init__(target_config, block_size, num_layers, target_layer_ids, mask_token_id, d2t, t2d)
        std, hidden = self.config.initializer_range, self.config.hidden_size
        draft_vocab = target_vocab if d2t is None else int(d2t.numel())
        self.markov_head = MarkovHead(target_vocab, draft_vocab, int(markov_rank))
        self.confidence_head = ConfidenceHead(hidden + int(markov_rank)) if confidence_head else None
        for m in (self.markov_head.markov_w1, self.markov_head.markov_w2):  # the bias starts near 0: DFlash's draft
            nn.init.normal_(m.weight, std=std)
        if self.confidence_head is not None:
            nn.init.normal_(self.confidence_head.proj.weight, std=std)
            nn.init.zeros_(self.confidence_head.proj.bias)

    @property
    def markov_rank(self) -> int:
        return self.markov_head.markov_w1.embedding_dim

    def block_logits(self, hidden: torch.Tensor,
                     prev: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Pre-norm hidden [..., H] of block slots and the token before each [...] (target ids) -> (fp32 logits
        [..., V_draft] with the Markov bias, fp32 confidence logits [...] before the sigmoid, None without a
        confidence head)."""
        return self.chain_step(self.logits(hidden), self.norm(hidden), prev)

    def chain_step(self, base: torch.Tensor, normed: torch.Tensor,
                   prev: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The two heads on slots whose DFlash logits `base` [..., V_draft] (fp32) and post-norm hidden `normed`
        [..., H] are known: block_logits' second half, which the drafter runs slot by slot once the token before
        each is drawn (the lm_head product stays one pass over the block)."""
        e = self.markov_head.markov_w1(prev)  # [..., r]
        logits = base + self.markov_head.markov_w2(e).float()
        if self.confidence_head is None:
            return logits, None
        return logits, self.confidence_head(torch.cat([normed, e], dim=-1)).float()

    def head_config(self) -> dict:
        return {**super().head_config(), "markov_rank": self.markov_rank,
                "confidence_head": self.confidence_head is not None}


def build_dspark(target_model, block_size: int = 8, num_layers: int = 3,
                 target_layer_ids: Optional[Sequence[int]] = None, mask_token_id: Optional[int] = None,
                 vocab_size: Optional[int] = None, markov_rank: int = 64, confidence_head: bool = True,
                 tokenizer=None, draft_vocab: Optional[torch.Tensor] = None, d2t: Optional[torch.Tensor] = None,
                 t2d: Optional[torch.Tensor] = None, **_unused) -> DSparkHead:
    """Head for `target_model`; one-line UserError for a config it cannot build. The body's options and vocabulary
    are DFlash's (build_dflash: d2t/t2d kept as saved, else `draft_vocab`, else the full vocabulary; `tokenizer`
    picks the mask token)."""
    def whole(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    if not whole(block_size) or not 2 <= block_size <= MAX_BLOCK_SIZE:
        raise UserError(f"dspark block_size={block_size!r}: must be an integer in [2, {MAX_BLOCK_SIZE}] (block "
                        "positions, each drafting the token after it; 1 leaves the Markov head nothing to chain)")
    if not whole(markov_rank) or not 1 <= markov_rank <= MAX_MARKOV_RANK:
        raise UserError(f"dspark markov_rank={markov_rank!r}: must be an integer in [1, {MAX_MARKOV_RANK}] (a head "
                        "without the Markov bias is draft=dflash)")
    if not isinstance(confidence_head, bool):
        raise UserError(f"dspark confidence_head={confidence_head!r}: must be true or false")
    body = dflash_options(target_model, block_size, num_layers, target_layer_ids, mask_token_id, vocab_size,
                          tokenizer, draft_vocab, d2t, t2d, kind="dspark")
    target_vocab = target_model.get_output_embeddings().weight.shape[0]
    head = DSparkHead(**body, target_vocab=target_vocab, markov_rank=markov_rank, confidence_head=confidence_head)
    return head.to(device=target_model.device, dtype=target_model.dtype).bind(target_model)
