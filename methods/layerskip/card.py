"""LayerSkip's part of the model card (publish/card.py): the head drawn in a few lines and its table rows."""

from __future__ import annotations

from typing import Any

import torch

from selfspec.publish.card import Rows


ADAPTER_TEXT = {"light": "z = h_E + up(silu(down(rmsnorm(h_E)))), a low-rank residual MLP (`up` starts at zero)",
            "layer": "z = one decoder layer of the target's family over h_E (Kangaroo), causal with its own KV cache",
            "lora": "z = h_E: the exit has no adapter; LoRA on layers 0..E-1, enabled only while drafting"}


def section(head: dict[str, Any], target: dict[str, Any], state: dict[str, torch.Tensor]) -> tuple[list[str], Rows]:
    """LayerSkip / Kangaroo: the target's own first E layers, an adapter, the target's own norm and lm_head."""
    exit_layer, n_layers = head.get("exit_layer"), head.get("num_target_layers") or target.get("num_hidden_layers")
    kind, vocab = head.get("adapter"), head.get("vocab_size")
    lines = [f"h_E    = the target's layers[0:{exit_layer}](embed(x))   # [B, T, {target.get('hidden_size')}]",
             f"z      = adapter(h_E)   # {kind}",
             "logits = the target's own lm_head(norm(z))" + (f"  # rows of the {vocab} draft tokens" if vocab else "")]
    adapter = ADAPTER_TEXT.get(kind, f"`{kind}`")
    if kind == "light":
        adapter += f", rank {head.get('rank')}"
    if kind == "lora":
        adapter += (f" (rank {head.get('lora_rank')}, alpha {head.get('lora_alpha')}, on "
                    f"{', '.join(head.get('lora_targets') or [])})")
    reuse = ("all the target's layers: the draft pass ran layers 0..E-1 with LoRA on, so their keys/values are not "
             "the target's" if kind == "lora" else
             f"the target reuses the draft pass's keys/values of layers 0..{exit_layer - 1} and runs only layers "
             f"{exit_layer}..{n_layers - 1} (self-speculative)")
    rows = [("type", "`layerskip`: self-speculative early exit, the target drafts with its own first layers"),
            ("exit layer", f"{exit_layer} of {n_layers} decoder layers (HF `hidden_states[{exit_layer}]`)"),
            ("adapter", f"`{kind}`: {adapter}"),
            ("verification", reuse),
            ("draft vocabulary", f"{vocab} most frequent target tokens (`draft_vocab`)" if vocab
             else f"the target's full vocabulary ({target.get('vocab_size')})"),
            ("target parts used", "embedding, layers 0..E-1, final norm and lm_head: by reference, not stored")]
    return lines, rows
