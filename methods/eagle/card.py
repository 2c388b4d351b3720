"""EAGLE-1/2's part of the model card (publish/card.py): the head drawn in a few lines and its table rows,
the commands of the engines that serve its exports."""

from __future__ import annotations

from typing import Any

import torch

from selfspec.publish.card import Rows, shape

SGLANG_FLAGS = "--speculative-num-steps 5 --speculative-eagle-topk 1 --speculative-num-draft-tokens 6"


def section(head: dict[str, Any], target: dict[str, Any], state: dict[str, torch.Tensor]) -> tuple[list[str], Rows]:
    """EAGLE-1/2: fc over (embedding, feature) pairs, then the family's own decoder layer(s)."""
    hidden, fc_in = shape(state, "fc.weight", (target.get("hidden_size"), None))
    vocab = head.get("vocab_size")
    lines = [f"x      = fc(cat(embed(token_t+1), f_t))   # [B, T, {fc_in}] -> [B, T, {hidden}]  (2H -> H)",
             f"f_t+1' = {head.get('num_layers', 1)} {target.get('model_type')} decoder layer(s)(x)  "
             "# no input norm on layer 0, no final norm",
             "logits = the target's lm_head(f_t+1')" + (f"  # rows of the {vocab} draft tokens" if vocab else "")]
    rows = [("type", "`eagle` (EAGLE-1/2): extrapolates the target's next post-norm hidden state"),
            ("fc", f"{fc_in} -> {hidden} (2H -> H), "
             + ("with bias (not servable by vLLM: use selfspec or SGLang)" if head.get("fc_bias") else "no bias")),
            ("decoder layers", f"{head.get('num_layers', 1)} ({target.get('model_type')} family)"),
            ("draft vocabulary", f"{vocab} most frequent target tokens (`draft_vocab`)" if vocab
             else f"the target's full vocabulary ({target.get('vocab_size')})"),
            ("embedding, lm_head", "the target's (held by reference, not stored)")]
    return lines, rows


def serving(repo_id: str, head: dict[str, Any], base: str, llama_layer: bool) -> list[str]:
    """The export + serve commands that apply to this head (publish/export.py's rules, stated for the reader)."""
    if not llama_layer:
        return []
    if head.get("fc_bias") or head.get("vocab_size"):
        why = "an fc bias" if head.get("fc_bias") else "a reduced draft vocabulary"
        out = [f"This head has {why}, which vLLM's EAGLE-1 loader cannot express; SGLang can:", ""]
    else:
        out = ["```bash", f"selfspec export head={repo_id} format=eagle out=eagle-head", "```", "",
               "```python", "from vllm import LLM, SamplingParams",
               f"llm = LLM(model=\"{base}\", speculative_config={{\"method\": \"eagle\", \"model\": \"eagle-head\", "
               "\"num_speculative_tokens\": 5})",
               "print(llm.generate([\"Explain KV caches.\"], SamplingParams(temperature=0, max_tokens=128))"
               "[0].outputs[0].text)",
               "```", ""]
    return out + ["```bash", f"selfspec export head={repo_id} format=sglang out=sglang-head",
                  f"python -m sglang.launch_server --model-path {base} --speculative-algorithm EAGLE "
                  f"--speculative-draft-model-path sglang-head {SGLANG_FLAGS}"
                  + (" --speculative-token-map sglang-head/hot_token_map.pt" if head.get("vocab_size") else ""),
                  "```", ""]


def unserved(head: dict[str, Any], target: dict[str, Any]) -> str:
    """Why no engine serves this head (when `serving` gives nothing)."""
    return ("their EAGLE loaders rebuild Llama decoder layers and this head's layer is a "
            f"`{target.get('model_type')}` one (head layer=target; retrain with draft.layer=llama, the default)")
