"""DFlash's part of the model card (publish/card.py): the head drawn in a few lines and its table rows,
the commands of the engines that serve its exports."""

from __future__ import annotations

from typing import Any

import torch

from selfspec.publish.card import Rows, shape


def section(head: dict[str, Any], target: dict[str, Any], state: dict[str, torch.Tensor]) -> tuple[list[str], Rows]:
    """DFlash: fc over several target layers, a few non-causal layers over [anchor, MASK x (S-1)], the target's
    embedding and lm_head."""
    ids = [int(i) for i in head.get("target_layer_ids") or []]
    hidden, fc_in = shape(state, "fc.weight", (target.get("hidden_size"), None))
    s, n = head.get("block_size"), sum(1 for k in state if k.endswith("input_layernorm.weight"))
    v_draft = int(state["d2t"].numel()) if "d2t" in state else None
    lines = [f"ctx    = hidden_norm(fc(cat(layer outputs {ids})))   # [B, T, {fc_in}] -> [B, T, {hidden}]",
             f"x      = embed([anchor, MASK x {s - 1 if s else 'S-1'}])   # the target's embedding, MASK = id "
             f"{head.get('mask_token_id')}",
             f"x      = {n} non-causal Qwen3-style layers(x; keys/values over cat(ctx, x))",
             "logits = the target's lm_head(norm(x))[1:]   # one draft per block position, all in ONE pass"
             + (f"; rows of the {v_draft} draft tokens" if v_draft else "")]
    rows = [("type", "`dflash` (DFlash): drafts a whole block in one non-causal pass"),
            ("block size", f"{s}: the anchor (last committed token) and {s - 1 if s else 'S-1'} drafted tokens"),
            ("target layer ids", f"{ids} (decoder layer i's OUTPUT = HF `hidden_states[i + 1]`; speculators, vLLM and "
                                 "llama.cpp store ids + 1)"),
            ("fc", f"{fc_in} -> {hidden} ({len(ids)} layers x H, no bias), then `hidden_norm`"),
            ("draft layers", f"{n}, bidirectional within the block, attending to the fused context of earlier "
                             "positions"),
            ("draft vocabulary", f"{v_draft} of the target's {target.get('vocab_size')} tokens (`d2t`/`t2d`)"
             if v_draft else f"the target's full vocabulary ({target.get('vocab_size')})"),
            ("embedding, lm_head", "the target's (held by reference, not stored)")]
    return lines, rows


def serving(repo_id: str, head: dict[str, Any], base: str, llama_layer: bool) -> list[str]:
    """The export + serve commands that apply to this head (publish/export.py's rules, stated for the reader)."""
    if head.get("vocab_size"):  # the engines' DFlash loaders need the draft's own lm_head rows then
        return []
    n = max(int(head.get("block_size") or 2) - 1, 1)
    out = ["```bash", f"selfspec export head={repo_id} format=speculators out=dflash-head",
           f"vllm serve {base} --speculative-config '{{\"method\": \"dflash\", \"model\": \"dflash-head\", "
           f"\"num_speculative_tokens\": {n}}}'", "```", ""]
    return out + ["```bash", f"selfspec export head={repo_id} format=gguf out=head.gguf",
                  f"llama-server -m <target.gguf> -md head.gguf --spec-type draft-dflash --spec-draft-n-max {n}",
                  "```", ""]


def unserved(head: dict[str, Any], target: dict[str, Any]) -> str:
    """Why no engine serves this head (when `serving` gives nothing)."""
    return ("their DFlash loaders need the draft's own lm_head rows, and this head drafts over a reduced vocabulary "
            "through the target's (retrain with draft.vocab_size=null)")
