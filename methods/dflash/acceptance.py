"""Held-out acceptance of a DFlash head at its own block size (training's eval, scripts/eval_heads.py): one block
drafted at every position of the target's greedy continuation, scored as decoding would accept it."""

from __future__ import annotations

import torch

from selfspec.eval.acceptance import acceptance_from_hits, progress


def block_acceptance(head, target, sequences: list[tuple[torch.Tensor, int]], chunk: int = 128) -> dict:
    """Held-out acceptance of a DFlash head at its own block size: tau = mean over anchors of 1 + accepted drafts
    (the bonus token counts), and acc@d (draft d accepted given drafts < d were), as chain_acceptance reports."""
    sequences = progress(sequences, f"held-out eval: drafting blocks of {head.block_size}")
    return acceptance_from_hits(*block_hits(head, target, sequences, chunk))


@torch.no_grad()
def block_hits(head, target, sequences: list[tuple[torch.Tensor, int]], chunk: int = 128) -> tuple[torch.Tensor, int]:
    """-> (hits [S-1]: blocks whose first d drafts all match the target's tokens, d = 1..S-1; number of blocks).

    Anchors a run from the first generated token (`start`: what the target commits after the prompt) to the last
    whose block fits, a + S-1 <= N-1. `chunk` anchors per head pass bound the logits' memory. Counts add up over
    sequences, like chain_hits'."""
    s = head.block_size
    hits = torch.zeros(s - 1)
    blocks = 0
    for ids, start in sequences:
        n_tok = ids.shape[1]
        if n_tok - s + 1 <= start:  # no block fits after the prompt
            continue
        anchors = torch.arange(start, n_tok - s + 1, device=ids.device)  # [M]
        hs = target.model.get_decoder()(input_ids=ids, output_hidden_states=True).hidden_states
        ctx = head.context(head.target_states(hs))  # [1, N, H]
        for part in anchors.split(chunk):
            hidden = head(ctx, ids, part[None])  # [1, M, S, H]
            drafts = head.to_target_ids(head.logits(hidden[:, :, 1:]).argmax(-1))[0]  # [M, S-1]
            want = ids[0, part[:, None] + torch.arange(1, s, device=ids.device)]  # [M, S-1] the target's tokens
            # draft d is accepted iff it and every draft before it match: the running product of matches
            accepted = (drafts == want).long().cumprod(dim=1)
            hits += accepted.sum(0).float().cpu()
            blocks += part.numel()
    return hits, blocks


def hits(head, target, sequences: list[tuple[torch.Tensor, int]], depth: int) -> tuple[torch.Tensor, int]:
    """eval/compare.py's measure (Method.hits): one block of the head's own size per position (`depth` unused)."""
    return block_hits(head, target, sequences)
