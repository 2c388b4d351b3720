"""Every head committed in heads/pretrained/ loads against the embedded SmolLM2 and decodes identically to it."""

import json
from pathlib import Path

import pytest
import torch

from selfspec.decode.drafters import build_drafter
from selfspec.decode.engine import generate

PRETRAINED = Path(__file__).resolve().parents[2] / "heads" / "pretrained"
SHIPPED = sorted(p for p in PRETRAINED.iterdir() if (p / "config.json").is_file())


def test_the_shipped_heads_are_the_eagle_eagle3_and_dflash_heads():
    types = {p.name: json.loads((p / "config.json").read_text())["head"]["type"] for p in SHIPPED}
    assert types == {"smollm2-135m-eagle": "eagle", "smollm2-135m-eagle3": "eagle3", "smollm2-135m-dflash": "dflash"}


@pytest.fixture(scope="module")
def reference():
    """The embedded target, a chat prompt and the target's own 40 greedy tokens after it (once for every head)."""
    from selfspec.target.model import load_target

    target = load_target("embedded:smollm2-135m")
    ids = target.tokenizer.apply_chat_template([{"role": "user", "content": "List three uses of a hash map."}],
                                               add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)["input_ids"]
    ref = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, min_new_tokens=40,
                                do_sample=False, eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:].tolist()
    return target, ids, ref


@pytest.mark.slow
@pytest.mark.parametrize("folder", SHIPPED, ids=lambda p: p.name)
def test_shipped_head_drafts_for_the_embedded_target_and_stays_lossless(folder, reference):
    target, ids, ref = reference
    kind = json.loads((folder / "config.json").read_text())["head"]["type"]
    options = [{"num_draft": 7}, {"num_draft": 15}] if kind == "dflash" else [  # a block drafter has no trees
        {"chain": chain, "num_draft": 5, "tree_depth": 4, "tree_top_k": 4, "tree_total_tokens": 16}
        for chain in (True, False)]
    for option in options:
        drafter = build_drafter(kind, target, head=str(folder), **option)
        r = generate(target, drafter, ids[0].tolist(), 40, eos_token_ids=[])
        assert r.tokens == ref
        assert r.tau > 1.2  # a trained head: an untrained one stays near 1.0 on this target
