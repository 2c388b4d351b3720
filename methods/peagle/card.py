"""P-EAGLE's part of the model card (publish/card.py): the head drawn in a few lines and its table rows,
the commands of the engines that serve its exports."""

from __future__ import annotations

from typing import Any

import torch

from selfspec.publish.card import Rows, shape


def section(head: dict[str, Any], target: dict[str, Any], state: dict[str, torch.Tensor]) -> tuple[list[str], Rows]:
    """P-EAGLE: EAGLE-3's fc and layers, every depth from one pass over [anchor, mask slots]."""
    aux = [int(k) for k in head.get("aux_layers") or []]
    hidden, fc_in = shape(state, "fc.weight", (target.get("hidden_size"), None))
    k, n = head.get("depth"), head.get("num_layers", 1)
    v_draft = int(state["d2t"].numel()) if "d2t" in state else head.get("vocab_size")
    lines = [f"anchor: (fc(cat(A_{', A_'.join(map(str, aux))})), next token)   # [B, T, {fc_in}] -> {hidden}",
             f"slots:  (fc(mask_hidden), id {head.get('mask_token_id')}) x {k - 1 if k else 'K-1'}   "
             "# positions after the anchor",
             f"out    = {n} Llama layer(s) over [anchor, slots], causal; the first over cat(norm(embed), "
             "hidden_norm(h))",
             f"logits = lm_head(norm(out))   # depth d from row d, all in ONE pass; {v_draft} draft tokens"]
    rows = [("type", "`peagle` (P-EAGLE): EAGLE-3 drafting every depth in one forward pass (vLLM parallel_drafting)"),
            ("depth", f"{k} tokens per draft pass"),
            ("aux layers", f"{aux} (HF `hidden_states` ids)"),
            ("layers", f"{n} Llama decoder layer(s); `mask_hidden` [{fc_in}] and mask token "
                       f"{head.get('mask_token_id')}"),
            ("draft vocabulary", f"{v_draft} of the target's {target.get('vocab_size')} tokens (`d2t`/`t2d`)"),
            ("embedding", "the target's (held by reference, not stored); lm_head and final norm are the head's own")]
    return lines, rows


def serving(repo_id: str, head: dict[str, Any], base: str, llama_layer: bool) -> list[str]:
    """The export + serve commands that apply to this head (publish/export.py's rules, stated for the reader)."""
    return ["```bash", f"selfspec export head={repo_id} format=speculators out=peagle-head",
            "vllm serve peagle-head   # parallel drafting: every speculative token from one draft pass", "```", ""]
