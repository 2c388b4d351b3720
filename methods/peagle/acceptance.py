"""Held-out acceptance of a P-EAGLE head (training's eval, scripts/eval_heads.py): every position drafts the head's
depth in one pass, as decoding does, scored as decoding would accept it."""

from __future__ import annotations

from typing import Optional

import torch

from selfspec.eval.acceptance import acceptance_from_hits, progress
from selfspec.methods.peagle.head import run_parallel


def parallel_acceptance(head, target, sequences: list[tuple[torch.Tensor, int]], depth: Optional[int] = None,
                        chunk: int = 256) -> dict:
    """Held-out acceptance of a P-EAGLE head: every position drafts `depth` tokens (default: the head's K) in one
    pass, as decoding does; tau and acc@d as chain_acceptance reports them."""
    depth = depth or head.depth
    sequences = progress(sequences, f"held-out eval: parallel drafts of {depth}")
    return acceptance_from_hits(*parallel_hits(head, target, sequences, depth, chunk))


@torch.no_grad()
def parallel_hits(head, target, sequences: list[tuple[torch.Tensor, int]], depth: int,
                  chunk: int = 256) -> tuple[torch.Tensor, int]:
    """-> (hits [depth]: drafts whose first d tokens all match the target, d = 1..depth; number of drafts), over the
    positions chain_hits counts. One pass per `chunk` anchors: the real pairs, then K-1 slots per anchor
    (heads.peagle.run_parallel). Counts add up over sequences."""
    hits = torch.zeros(depth)
    drafts = 0
    for ids, start in sequences:
        n_tok = ids.shape[1]
        n = n_tok - 1  # pairs (aux_i, x_{i+1}), i = 0..N-2
        first, last = max(start - 1, 0), n_tok - depth - 2
        if last < first:
            continue
        aux = head.aux_states(target.model.get_decoder()(input_ids=ids, output_hidden_states=True).hidden_states)
        attn = torch.ones(1, n, dtype=torch.long, device=ids.device)
        for part in torch.arange(first, last + 1, device=ids.device).split(chunk):
            outs = run_parallel(head, aux[:, :n], ids[:, 1:], attn, [part] * (depth - 1))
            rows = [outs[0][:, part], *outs[1:]]  # [1, M, H] per depth
            tokens = torch.stack([head.to_target_ids(head.logits(r).argmax(-1))[0] for r in rows], dim=1)  # [M, K]
            want = ids[0, part[:, None] + 2 + torch.arange(depth, device=ids.device)]  # x_{i+2+d}
            hits += (tokens == want).long().cumprod(dim=1).sum(0).float().cpu()
            drafts += part.numel()
    return hits, drafts


def hits(head, target, sequences: list[tuple[torch.Tensor, int]], depth: int) -> tuple[torch.Tensor, int]:
    """eval/compare.py's measure (Method.hits): the head's own depth in one pass per position (`depth` unused)."""
    return parallel_hits(head, target, sequences, head.depth)
