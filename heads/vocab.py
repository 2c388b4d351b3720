"""Reduced draft vocabularies: the N most frequent loss-masked (assistant) tokens of the training data.

The mapping is chosen once, saved in the head's checkpoint and never rebuilt when a head is fine-tuned
(SpecForge PR #534 rebuilt it on fine-tuning and broke acceptance). It is saved in one of two forms:
    draft_vocab  (EAGLE, LayerSkip)  int64 [V_draft]: draft id i -> target id draft_vocab[i]
    d2t, t2d     (EAGLE-3, the form vLLM, SGLang and speculators read)  d2t int64 [V_draft]: target id =
                 i + d2t[i]; t2d bool [V_target]: True for the target ids the draft can emit
`vocab_maps` turns the first into the second and `draft_to_target` turns d2t back: every conversion goes through
them. `full_vocabulary` drops an EAGLE-1 map (for engines without one). `check_vocab_maps` refuses a saved mapping
that does not fit the target it is loaded for.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch

from selfspec.core.errors import UserError


def top_tokens(sequences: Iterable[tuple[Sequence[int], Sequence[int]]], vocab_size: int, n: int,
               always: Sequence[int] = ()) -> torch.Tensor:
    """Ids of the `n` most frequent masked tokens over (input_ids, loss_mask) pairs, most frequent first.
    `always` (e.g. end-of-turn ids) are included whatever their count; ties break by lower id."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids, mask in sequences:
        ids_t = torch.as_tensor(ids, dtype=torch.long)
        counts += torch.bincount(ids_t[torch.as_tensor(mask, dtype=torch.bool)], minlength=vocab_size)[:vocab_size]
    for t in always:
        counts[t] = counts.max() + 1
    n = min(n, vocab_size)
    # stable sort by (-count, id)
    order = torch.argsort(-counts * (vocab_size + 1) + torch.arange(vocab_size), stable=True)
    return order[:n].clone()


def coverage(draft_vocab: torch.Tensor, sequences: Iterable[tuple[Sequence[int], Sequence[int]]]) -> float:
    """Share of masked tokens that the draft vocabulary can express."""
    inside = torch.zeros(int(draft_vocab.max()) + 1, dtype=torch.bool)
    inside[draft_vocab] = True
    hit = total = 0
    for ids, mask in sequences:
        ids_t = torch.as_tensor(ids)[torch.as_tensor(mask, dtype=torch.bool)]
        total += ids_t.numel()
        hit += int(inside[ids_t.clamp(max=inside.numel() - 1)].logical_and(ids_t < inside.numel()).sum())
    return hit / max(total, 1)


def vocab_maps(draft_vocab: torch.Tensor, target_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target ids of the draft vocabulary (draft id i -> target id draft_vocab[i]) -> (d2t [V_draft] int64,
    t2d [V_target] bool). The order is kept: a head whose lm_head rows follow the target's order passes ascending
    ids, so that logits[..., t2d] and the d2t-mapped ids agree."""
    draft_vocab = draft_vocab.to(torch.long)
    if draft_vocab.unique().numel() != draft_vocab.numel() or int(draft_vocab.max()) >= target_vocab:
        raise ValueError("draft vocabulary ids must be distinct target ids")
    d2t = draft_vocab - torch.arange(draft_vocab.numel(), device=draft_vocab.device)
    t2d = torch.zeros(target_vocab, dtype=torch.bool, device=draft_vocab.device)
    t2d[draft_vocab] = True
    return d2t, t2d


def draft_to_target(d2t: torch.Tensor) -> torch.Tensor:
    """d2t [V_draft] -> the target id of every draft id [V_draft] int64 (vocab_maps' draft_vocab back)."""
    return torch.arange(d2t.numel(), device=d2t.device) + d2t.to(torch.long)


def full_vocabulary(record: dict, state: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """An EAGLE-1 head drafting over the target's whole vocabulary: its `draft_vocab` map dropped, so its logits
    come from every row of the target's lm_head, which is what vLLM's EAGLE-1 loader serves (it has no id map).
    The head was trained on the reduced rows only, yet lost nothing: the shipped head's held-out tau (48 prompts)
    is 2.431 reduced and 2.444 full (docs/results.md). The record keeps the reduced size it was trained with as
    `trained_vocab_size`."""
    head = record["head"]
    if head["type"] != "eagle":
        raise UserError(f"expand_vocab applies to EAGLE-1 heads; a '{head['type']}' head keeps its own vocabulary "
                        "(EAGLE-3 heads carry the d2t map the engines read)")
    if "draft_vocab" not in state:
        return record, state
    record = {**record, "head": {**head, "vocab_size": None}, "trained_vocab_size": int(state["draft_vocab"].numel())}
    return record, {k: v for k, v in state.items() if k != "draft_vocab"}


def check_vocab_maps(state: dict[str, torch.Tensor], vocab_size: Optional[int], target_vocab: int, where: str) -> None:
    """Refuse, in one line, a checkpoint's draft-vocabulary maps that would index outside the target's vocabulary
    (an IndexError, or a device-side assert on CUDA, at the first draft) or disagree with the head:
    `draft_vocab` (EAGLE, LayerSkip: draft id i -> target id draft_vocab[i]), `d2t` (EAGLE-3: target id = i + d2t[i])
    with its `t2d` (bool [V_target]: the target ids the draft can emit) and the head's own `lm_head.weight` rows.
    `vocab_size` is the head config's (None = the full vocabulary); `target_vocab` the target's lm_head rows."""
    for name in ("draft_vocab", "d2t"):
        t = state.get(name)
        if t is None:
            continue
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise UserError(f"{where}: {name} must hold integer token ids, not {t.dtype}; re-export the head")
        if t.dim() != 1:
            raise UserError(f"{where}: {name} must be 1-D, it has shape {list(t.shape)}; re-export the head")
        if vocab_size is not None and t.numel() != vocab_size:
            raise UserError(f"{where}: {name} has {t.numel()} ids but the head's config says vocab_size={vocab_size}")
    if "draft_vocab" in state:
        _in_range(state["draft_vocab"], target_vocab, f"{where}: draft_vocab")
    if "d2t" in state:
        d2t, t2d = state["d2t"], state.get("t2d")
        ids = draft_to_target(d2t)  # the target id of every draft id
        _in_range(ids, target_vocab, f"{where}: d2t (draft id + d2t)")
        if t2d is None or t2d.dtype != torch.bool or list(t2d.shape) != [target_vocab]:
            got = "none" if t2d is None else f"{t2d.dtype} {list(t2d.shape)}"
            raise UserError(f"{where}: t2d must be a bool mask over the target's {target_vocab} ids (got {got}); "
                            "re-export the head")
        mask = torch.zeros(target_vocab, dtype=torch.bool, device=t2d.device)  # a head's state may be on a GPU
        mask[ids.to(t2d.device)] = True
        if ids.unique().numel() != ids.numel() or not torch.equal(mask, t2d):
            raise UserError(f"{where}: t2d disagrees with d2t (they must name the same {d2t.numel()} distinct target "
                            "ids); re-export the head")
        rows = state.get("lm_head.weight")
        if rows is not None and rows.shape[0] != d2t.numel():
            raise UserError(f"{where}: d2t maps {d2t.numel()} draft ids but lm_head.weight has {rows.shape[0]} rows; "
                            "re-export the head")


def _in_range(ids: torch.Tensor, n: int, what: str) -> None:
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
        raise UserError(f"{what} holds ids outside the target's vocabulary [0, {n}) (min {int(ids.min())}, max "
                        f"{int(ids.max())}): a head for another tokenizer? re-export it for this target")
