"""Held-out acceptance of a DSpark head (training's eval, scripts/eval_heads.py through Method.hits), as DFlash's
(methods/dflash/acceptance.py): one block of the head's own size drafted greedily at every position of the target's
greedy continuations, tau = 1 + its accepted prefix.

A greedy slot k is accepted only if slots 0..k-1 were, and then the tokens it was chained on are the target's own:
so chaining each slot on the target's token before it (teacher forcing, one head pass for many anchors) counts
exactly the prefix the drafter would get accepted; past the first miss nothing more is counted.
"""

from __future__ import annotations

import torch

from selfspec.eval.acceptance import acceptance_from_hits, progress


def block_acceptance(head, target, sequences: list[tuple[torch.Tensor, int]], chunk: int = 128) -> dict:
    """tau and acc@d (draft d accepted given drafts < d were) of `head` over `sequences` ((ids [1, N], start))."""
    sequences = progress(sequences, f"held-out eval: drafting DSpark blocks of {head.block_size}")
    return acceptance_from_hits(*block_hits(head, target, sequences, chunk))


@torch.no_grad()
def block_hits(head, target, sequences: list[tuple[torch.Tensor, int]], chunk: int = 128) -> tuple[torch.Tensor, int]:
    """-> (hits [S]: blocks whose first d drafts all match the target's tokens, d = 1..S; number of blocks).

    Anchors run from the first generated token (`start`) to the last whose S drafts lie in the sequence,
    a + S <= N-1; slot k of anchor a drafts token a+k+1. Counts add up over sequences, as eval/acceptance.py's."""
    s = head.block_size
    hits = torch.zeros(s)
    blocks = 0
    for ids, start in sequences:
        n_tok = ids.shape[1]
        if n_tok - s <= start:  # no block fits after the prompt
            continue
        anchors = torch.arange(start, n_tok - s, device=ids.device)  # [M]
        hs = target.model.get_decoder()(input_ids=ids, output_hidden_states=True).hidden_states
        ctx = head.context(head.target_states(hs))  # [1, N, H]
        for part in anchors.split(chunk):
            hidden = head(ctx, ids, part[None])[0]  # [M, S, H]
            at = part[:, None] + torch.arange(s + 1, device=ids.device)  # [M, S+1]: the anchor and the S tokens after
            logits, _ = head.block_logits(hidden, ids[0, at[:, :-1]])  # each slot chained on the token before it
            drafts = head.to_target_ids(logits.argmax(-1))  # [M, S]
            accepted = (drafts == ids[0, at[:, 1:]]).long().cumprod(dim=1)
            hits += accepted.sum(0).float().cpu()
            blocks += part.numel()
    return hits, blocks


def hits(head, target, sequences: list[tuple[torch.Tensor, int]], depth: int) -> tuple[torch.Tensor, int]:
    """eval/compare.py's measure (Method.hits): one block of the head's own size per position (`depth` unused)."""
    return block_hits(head, target, sequences)
