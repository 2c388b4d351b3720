"""EAGLE-3 heads draft as EAGLE-1's do (methods/eagle/drafter.py): a chain of K tokens or an EAGLE-2 dynamic tree;
the drafter reads the head's aux-layer states at its first step."""

from __future__ import annotations

from typing import Any, Optional

from selfspec.core.errors import UserError
from selfspec.decode.drafters import load_head_for, vocab_size_of
from selfspec.methods.eagle.drafter import EagleDrafter


def build(target, head: Any = None, chain: bool = True, num_draft: Optional[int] = None, tree_depth: int = 5,
          tree_top_k: int = 8, tree_total_tokens: int = 32, min_confidence: float = 0.0,
          head_revision: Optional[str] = None, siblings: int = 0, sibling_depth: int = 0, **_):
    head = load_head_for(target, head, "eagle3", head_revision)
    if getattr(head, "head_type", None) != "eagle3":
        kind = getattr(head, "head_type", "?")
        raise UserError(f"drafter=eagle3 needs an EAGLE-3 head; this head is '{kind}' (use drafter={kind})")
    return EagleDrafter(head, vocab_size_of(target), chain=chain, num_draft=num_draft, depth=tree_depth,
                        top_k=tree_top_k, total_tokens=tree_total_tokens, min_confidence=min_confidence,
                        siblings=siblings, sibling_depth=sibling_depth)
