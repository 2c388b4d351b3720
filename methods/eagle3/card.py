"""EAGLE-3's part of the model card (publish/card.py): the head drawn in a few lines and its table rows,
the commands of the engines that serve its exports."""

from __future__ import annotations

from typing import Any

import torch

from selfspec.publish.card import Rows, shape

SGLANG_FLAGS = "--speculative-num-steps 5 --speculative-eagle-topk 1 --speculative-num-draft-tokens 6"


def section(head: dict[str, Any], target: dict[str, Any], state: dict[str, torch.Tensor]) -> tuple[list[str], Rows]:
    """EAGLE-3: fc over three target layers, a midlayer over (embedding, hidden), its own lm_head."""
    aux = [int(k) for k in head.get("aux_layers") or []]
    hidden, fc_in = shape(state, "fc.weight", (target.get("hidden_size"), None))
    _, mid_in = shape(state, "layers.0.self_attn.q_proj.weight", (None, None))
    v_draft = int(state["d2t"].numel()) if "d2t" in state else head.get("vocab_size")
    fused = ", ".join(f"A_{k}" for k in aux)
    lines = [f"step 0: h = fc(cat({fused}))   # [B, T, {fc_in}] -> [B, T, {hidden}]: target hidden_states {aux}",
             "step j: h = the head's own pre-norm output of step j-1",
             f"x      = cat(input_layernorm(embed(token)), hidden_norm(h))   # [B, T, {mid_in}]: q/k/v take 2H",
             "out    = h + attn(x);  out = out + mlp(post_attention_layernorm(out))",
             f"logits = lm_head(norm(out))   # the head's own lm_head over {v_draft} draft tokens; d2t -> target ids"]
    rows = [("type", "`eagle3` (EAGLE-3): drafts from fused target layers, then from its own output"),
            ("aux layers", f"{aux} (HF `hidden_states` ids: the un-normed residual stream after k layers)"),
            ("fc", f"{fc_in} -> {hidden} ({len(aux)} aux layers x H, no bias)"),
            ("midlayer", f"one {target.get('model_type')} decoder layer, q/k/v over {mid_in} (2H) inputs, "
                         "plus `hidden_norm`"),
            ("norm before residual", "yes" if head.get("norm_before_residual") else None),
            ("draft vocabulary", f"{v_draft} of the target's {target.get('vocab_size')} tokens "
                                 "(`d2t` draft -> target, `t2d` target -> drafted)"),
            ("embedding", "the target's (held by reference, not stored); lm_head and final norm are the head's own")]
    return lines, rows


def serving(repo_id: str, head: dict[str, Any], base: str, llama_layer: bool) -> list[str]:
    """The export + serve commands that apply to this head (publish/export.py's rules, stated for the reader)."""
    out: list[str] = []
    aux = head.get("aux_layers") or []
    if llama_layer and len(set(aux)) == len(aux):  # vLLM's: each layer read once
        out += ["```bash", f"selfspec export head={repo_id} format=speculators out=eagle3-head",
                "vllm serve eagle3-head   # verifier and speculative tokens come from its config.json", "```", ""]
    if llama_layer and not head.get("norm_before_residual"):
        out += ["```bash", f"selfspec export head={repo_id} format=sglang out=sglang-head",
                f"python -m sglang.launch_server --model-path {base} --speculative-algorithm EAGLE3 "
                f"--speculative-draft-model-path sglang-head {SGLANG_FLAGS}", "```", ""]
    if llama_layer and len(head.get("aux_layers") or []) == 3:  # llama.cpp reads exactly 3 layers
        out += ["```bash", f"selfspec export head={repo_id} format=gguf out=head.gguf",
                "llama-server -m <target.gguf> -md head.gguf --spec-type draft-eagle3 --spec-draft-n-max 5 "
                "--spec-draft-p-min 0.5",
                "```", ""]
    return out


def unserved(head: dict[str, Any], target: dict[str, Any]) -> str:
    """Why no engine serves this head (when `serving` gives nothing)."""
    return ("their EAGLE loaders rebuild Llama decoder layers and this head's layer is a "
            f"`{target.get('model_type')}` one (head layer=target; retrain with draft.layer=llama, the default)")
