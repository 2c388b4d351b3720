"""target/attention.py: a CPU target attends with grouped K/V heads in place under a tree mask (no repeat_kv copy),
to the bit what HF's sdpa computes, and stays on HF's sdpa wherever that one alone applies."""

from __future__ import annotations

import pytest
import torch
import transformers.integrations.sdpa_attention as hf_sdpa

from selfspec.decode import kv
from selfspec.decode.draft import Draft
from selfspec.target import attention
from selfspec.target.model import load_target

GROUPED = ["llama", "qwen2", "qwen3", "gemma3", "mistral", "smollm3"]  # tiny configs with 4 query heads over 2 K/V


def _tree_pass(target, context: int = 40):
    """Logits of a 5-node tree (two branches) verified over a cache of `context` tokens: [1, 5, V]."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 200, (1, context + 5), generator=g)
    cache = kv.new_cache()
    with torch.inference_mode():
        kv.decoder_forward(target.model, ids[:, :context], torch.arange(context)[None], cache, logits_from=context - 1)
        draft = Draft(ids[0, context + 1:].tolist(), [-1, 0, -1, 2])  # two branches of two under the root
        positions = context + torch.tensor([0] + draft.depths())
        mask = kv.attention_mask(kv.text_config(target.model), context, draft.ancestor_mask(), positions,
                                 torch.float32)
        return kv.decoder_forward(target.model, ids[:, context:], positions[None], cache, mask=mask)[1]


@pytest.mark.kernels
@pytest.mark.parametrize("family", GROUPED)
def test_grouped_heads_in_place_are_sdpa_to_the_bit(family, monkeypatch):
    ours = load_target(f"tiny:{family}", seed=3, kernels="default")
    assert ours.model.config._attn_implementation == attention.NAME
    hf = load_target(f"tiny:{family}", seed=3, kernels="default")
    hf.model.set_attn_implementation("sdpa")
    want = _tree_pass(hf)

    def no_copy(*a, **k):
        raise AssertionError("repeat_kv ran: the grouped heads were copied")

    monkeypatch.setattr(hf_sdpa, "repeat_kv", no_copy)
    assert torch.equal(_tree_pass(ours), want)


def test_hf_sdpa_where_it_alone_applies(monkeypatch):
    t = load_target("tiny:llama", seed=3, kernels="default")
    layer = t.model.model.layers[0].self_attn
    q, k = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 7, 16)
    mask = torch.ones(1, 1, 3, 7, dtype=torch.bool)
    calls, hf = [], attention.sdpa_attention_forward
    monkeypatch.setattr(attention, "sdpa_attention_forward", lambda *a, **kw: calls.append(kw) or hf(*a, **kw))
    for extra in ({"softcap": 30.0}, {"output_attentions": True}):  # HF raises or warns: it must see them
        calls.clear()
        with pytest.raises(ValueError) if "softcap" in extra else torch.inference_mode():
            attention.sdpa_gqa_forward(layer, q, k, k, mask, **extra)
        assert calls
    eager = load_target("tiny:llama", seed=3, kernels="default")
    eager.model.set_attn_implementation("eager")
    assert not attention.use(eager.model)  # an eager (or flash) target is left as it is
