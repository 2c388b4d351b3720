"""DSpark's part of the model card (publish/card.py): DFlash's section (its body's, through the registry) read
anchor-first, plus the two heads."""

from __future__ import annotations

from typing import Any

import torch

from selfspec.registry import method


def section(head: dict[str, Any], target: dict[str, Any], state: dict[str, torch.Tensor]):
    """(diagram lines, table rows) for a dspark head's record `head`, its target's record and its weights."""
    lines, rows = method("dflash").load("card").section(head, target, state)
    s, r = head.get("block_size"), head.get("markov_rank")
    conf = bool(head.get("confidence_head", "confidence_head.proj.weight" in state))
    lines = lines[:-1] + [
        "logits = the target's lm_head(norm(x)) + markov_w2(markov_w1[previous token])   # slot k drafts token "
        "anchor+k+1, chained slot by slot on the token drawn before it",
        *(["conf   = sigmoid(proj(cat(norm(x), markov_w1[previous token])))   # each slot's chance of acceptance: "
           "the block is cut where their product falls low"] if conf else [])]
    own = {"type": "`dspark` (DSpark): a DFlash block chained by a Markov head" + (", cut by a confidence head"
                                                                                   if conf else ""),
           "block size": f"{s}: the anchor (last committed token) and {s - 1 if s else 'S-1'} mask positions, each "
                         f"drafting the token after it: {s or 'S'} tokens per pass"}
    rows = [(k, own.get(k, v)) for k, v in rows]
    rows += [("markov head", f"rank {r}: markov_w1 [target vocabulary, {r}], markov_w2 [draft vocabulary, {r}]"),
             ("confidence head", f"a linear map of (hidden, markov_w1 row) [H + {r}] -> 1" if conf else "none")]
    return lines, rows


def serving(repo_id: str, head: dict[str, Any], base: str, llama_layer: bool) -> list[str]:
    """The export + serve commands that apply to this head: llama.cpp's draft-dspark (tests/engines/
    test_dspark_llamacpp.py serves one). A reduced draft vocabulary exports nowhere (methods/dspark/formats.py)."""
    if head.get("vocab_size"):
        return []
    n = int(head.get("block_size") or 2)
    return ["```bash", f"selfspec export head={repo_id} format=gguf out=head.gguf",
            f"llama-server -m <target.gguf> -md head.gguf --spec-type draft-dspark --spec-draft-n-max {n} "
            "[--spec-draft-p-min P]", "```", ""]


def unserved(head: dict[str, Any], target: dict[str, Any]) -> str:
    """Why no engine serves this head (when `serving` gives nothing)."""
    return ("its draft vocabulary is reduced through rows of the target's lm_head, and the engines' DSpark loaders "
            "need the draft's own rows (retrain with draft.vocab_size=null)")
