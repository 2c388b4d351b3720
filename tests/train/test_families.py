"""Every target family of target/tiny.py through every recipe (a few steps, in-process), lossless decoding with the
trained head (greedy tokens identical to the target's own HF greedy, fp32, past the sliding windows), and every
export that applies to the head. What a family or a format cannot do is refused in one line, and asserted here:
this file is the run behind docs/targets.md's table."""

from __future__ import annotations

import functools
import importlib
import json

import pytest
import torch

from selfspec.core.errors import UserError
from selfspec.target.model import load_target
from selfspec.registry import method, names
from selfspec.train.tiny import TINY_TRAIN_ARGS
from selfspec.decode.drafters import build_drafter
from selfspec.decode.engine import generate
from selfspec.heads.checkpoint import load_head, read_head
from selfspec.publish.export import convert, to_gguf, write_export

# The CI/dev machines have 2 cores shared with other jobs; tiny models run fastest (and steadiest) on one thread.
torch.set_num_threads(1)

# family (tiny:<family>, conf/target/tiny-<family>.yaml) -> its HF model_type
FAMILIES = {"llama": "llama", "llama3": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe",
            "gemma3": "gemma3_text", "mistral": "mistral", "phi3": "phi3", "gpt_oss": "gpt_oss",
            "granite": "granite", "olmo2": "olmo2", "smollm3": "smollm3"}
# A byte-level prompt of 100+ tokens: every draft is verified past the 64-token sliding windows (gemma3, mistral,
# gpt-oss), so few new tokens are needed (each costs a target pass: 2-step heads are rarely right).
PROMPT = "Tell me about speculative decoding: how a small draft model proposes tokens and the target verifies them."
NEW = 24
COMMON = TINY_TRAIN_ARGS
# recipe -> (its entry point's module, its overrides): each method the tiny trainings run (registry.py `tiny`)
RECIPES = {n: (method(n).recipe, list(method(n).tiny)) for n in names() if method(n).tiny is not None}
# drafter options per recipe: a chain and a tree (trees pass our own 4-D masks, sliding windows included)
DECODES = {"eagle": [{"num_draft": 4}, {"chain": False, "tree_depth": 3, "tree_top_k": 2, "tree_total_tokens": 8}],
           "eagle3": [{"num_draft": 4}, {"chain": False, "tree_depth": 3, "tree_top_k": 2, "tree_total_tokens": 8}],
           "layerskip": [{"num_draft": 3}], "dflash": [{"num_draft": 3}],
           "dspark": [{}, {"num_draft": 2, "min_confidence": 0.2}]}  # its whole block; cut by its confidence head
FORMATS = {"eagle": ["eagle", "speculators", "sglang"], "eagle3": ["speculators", "sglang", "gguf"], "layerskip": [],
           "dflash": ["speculators", "sglang", "gguf"], "dspark": ["speculators", "sglang", "gguf"]}

# What is refused, and the words of its one-line reason. Everything else must train, decode losslessly and export.
# The EAGLE recipes train layer=llama heads (the default): the engines' Llama draft layer, for every family.
REFUSED = {
    # 2 layers: the head reads hidden_states [1, 1, 1], and vLLM collects each layer once
    **{(f, "eagle3", "speculators"): "some twice" for f in FAMILIES},
}


@functools.lru_cache(maxsize=None)
def _target(family: str):
    return load_target(f"tiny:{family}")


def _prompt(target) -> list[int]:
    ids = target.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                               tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@functools.lru_cache(maxsize=None)
def _reference(family: str) -> list[int]:
    """The target's own greedy decoding with HF generate (no end-of-turn stop)."""
    target = _target(family)
    ids = torch.tensor([_prompt(target)])
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                                do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def _export(record, state, target, fmt, out):
    if fmt == "gguf":  # the pure conversion holds every check; the file needs the target's own GGUF tokenizer
        return to_gguf(record, state, target.config)
    return write_export(convert(record, state, target.config, fmt), record, out)


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_trains_decodes_losslessly_and_exports(family, recipe, tmp_path):
    module, extra = RECIPES[recipe]
    main = importlib.import_module(module).main
    out = tmp_path / "run"
    result = main([f"target=tiny-{family.replace('_', '-')}", *COMMON, *extra, f"output_dir={out}"])
    assert result["steps"] == 2
    record = json.loads((out / "head" / "config.json").read_text())
    assert record["target"]["model_type"] == FAMILIES[family] and record["head"]["type"] == recipe

    # lossless: the trained head drafts, the engine's greedy output is the target's own
    target = _target(family)
    head = load_head(str(out / "head"), target, expected_type=recipe)
    prompt, ref = _prompt(target), _reference(family)
    assert len(prompt) > 64
    for options in DECODES[recipe]:
        r = generate(target, build_drafter(recipe, target, head=head, **options), prompt, NEW, eos_token_ids=[])
        assert r.tokens == ref, (family, recipe, options)

    # exports: each written (or converted) whole, or refused in one line that says why
    record, state = read_head(str(out / "head"))
    for fmt in FORMATS[recipe]:
        why = REFUSED.get((family, recipe, fmt))
        if why is None:
            assert _export(record, state, target, fmt, tmp_path / fmt)
            continue
        with pytest.raises(UserError) as e:
            _export(record, state, target, fmt, tmp_path / fmt)
        assert why in str(e.value) and "\n" not in str(e.value), (fmt, str(e.value))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_accepts_drafts_losslessly(family):
    """The test oracle drafts the target's own greedy tokens, so every round accepts whole chains and trees: the
    family's caches are committed and cropped past its sliding windows (a trained 2-step head is rarely right)."""
    target = _target(family)
    for options in ({"num_draft": 4}, {"num_draft": 3, "width": 2}):
        r = generate(target, build_drafter("oracle", target, **options), _prompt(target), NEW, eos_token_ids=[])
        assert r.tokens == _reference(family) and r.tau > 3, (family, options)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_a_family_no_head_can_serve_is_refused_at_start(recipe, tmp_path, capsys):
    """Qwen3-Next builds and runs on a CPU, but its linear-attention layers keep a recurrent state that rejected
    drafts cannot be rolled back from: every recipe refuses it in one line as it loads the target, before any head."""
    module, extra = RECIPES[recipe]
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        importlib.import_module(module).main(["target=tiny-qwen3-next", *COMMON, *extra, f"output_dir={out}"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "'qwen3_next'" in err and "linear_attention" in err
    assert not (out / "head").exists()
