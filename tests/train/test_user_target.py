"""A user's own model and data, the README's "your own model" path: a tiny random target saved with
`save_pretrained` in bf16 / fp16 and loaded through `target=hf target.name_or_path=<folder>` (the real loading code),
conversations from a JSONL file, a `save_to_disk` folder and a parquet file. Every recipe trains a few steps at
the dtypes people use (the head's master weights fp32 whatever the target's), on one process and on two, and the
head then decodes (identical to the target's own greedy at fp32), benchmarks, evaluates, exports and publishes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from harness.two_ranks import head_digests
from selfspec.target.model import load_target
from selfspec.target.tiny import build_tiny_target

ROOT = Path(__file__).resolve().parents[2]
RECIPES = {"eagle": "selfspec.methods.eagle.train", "eagle3": "selfspec.methods.eagle3.train",
           "layerskip": "selfspec.methods.layerskip.train", "dflash": "selfspec.methods.dflash.train"}
# each recipe's own options for a 2-layer target (EAGLE-3: two distinct layers, as vLLM reads each layer once)
DRAFT = {"eagle": [], "eagle3": ["ttt.steps=2", "draft.aux_layers=[0,1]"], "layerskip": ["draft.exit_layer=1"],
         "dflash": ["draft.block_size=4", "draft.num_layers=1", "dflash.anchors=8"]}
TRAIN = ["train.max_steps=2", "train.lr=3e-3", "train.eval_prompts=2", "train.eval_new_tokens=8", "train.eval_every=0",
         "data.max_length=96", "data.heldout_fraction=0.1"]


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    """The user's files: the target saved in bf16 and fp16, and one set of conversations in three forms."""
    import datasets

    d = tmp_path_factory.mktemp("user")
    model, tok = build_tiny_target("llama", seed=3)
    for dtype in ("bfloat16", "float16"):
        model.to(getattr(torch, dtype)).save_pretrained(d / dtype)
        tok.save_pretrained(d / dtype)
    model.save_pretrained(d / "base")  # a base model: no chat template (as Gemma-3-270M)
    tok.chat_template = None
    tok.save_pretrained(d / "base")
    rows = [{"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"What comes after {i}?"},
        {"from": "gpt", "value": f"After {i} comes {i + 1}, and then {i + 2}. Counting is fun."}]} for i in range(24)]
    (d / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = datasets.Dataset.from_list(rows)
    ds.save_to_disk(str(d / "chats_ds"))
    ds.to_parquet(str(d / "chats.parquet"))
    return d


def _data(user: Path, form: str) -> list[str]:
    return {"jsonl": ["data=jsonl", f"data.path={user / 'chats.jsonl'}"],
            "disk": ["data=hf", f"data.path={user / 'chats_ds'}"],
            "parquet": ["data=hf", f"data.path={user / 'chats.parquet'}"]}[form]


def _train(recipe: str, args: list[str]) -> dict:
    import importlib

    return importlib.import_module(RECIPES[recipe]).main(args)


# recipe, the folder's dtype, how it is loaded (target.dtype), data form, train.mixed_precision, extra options
CASES = [
    ("eagle", "bfloat16", "bfloat16", "jsonl", "no", []),
    ("eagle", "float16", "float16", "disk", "bf16", ["draft.vocab_size=64"]),
    ("eagle", "bfloat16", "bfloat16", "parquet", "fp16", ["train.features_dtype=bfloat16"]),
    ("eagle3", "bfloat16", "bfloat16", "disk", "no", ["draft.vocab_size=64"]),
    ("eagle3", "float16", "float16", "jsonl", "fp16", []),
    ("eagle3", "bfloat16", "float32", "parquet", "bf16", []),
    ("layerskip", "bfloat16", "bfloat16", "parquet", "no", []),
    ("layerskip", "float16", "float16", "jsonl", "bf16", ["draft.adapter=layer"]),
    ("layerskip", "bfloat16", "bfloat16", "disk", "fp16", ["draft.adapter=lora"]),
    ("dflash", "bfloat16", "bfloat16", "parquet", "no", ["draft.vocab_size=64"]),
    ("dflash", "float16", "float16", "disk", "bf16", []),
    # a base model: training, its held-out eval and the data all render with the ChatML fallback
    ("eagle3", "base", "float32", "jsonl", "no", ["data.chat_template=chatml"]),
]


@pytest.mark.parametrize("recipe,folder,dtype,form,mp,extra", CASES,
                         ids=[f"{c[0]}-{c[1]}-as-{c[2]}-{c[3]}-mp_{c[4]}" for c in CASES])
def test_every_recipe_trains_on_a_saved_target(user, tmp_path, recipe, folder, dtype, form, mp, extra):
    out = tmp_path / "run"
    result = _train(recipe, ["target=hf", f"target.name_or_path={user / folder}", f"target.dtype={dtype}",
                             *_data(user, form), *TRAIN, *DRAFT[recipe], *extra, f"train.mixed_precision={mp}",
                             "train.save_every=1", "train.keep_last=2", f"output_dir={out}"])
    assert result["steps"] == 2 and torch.isfinite(torch.tensor(result["final_loss"]))
    first, last = (load_file(str(out / "checkpoints" / f"step_{s:08d}" / "head.safetensors")) for s in (1, 2))
    head = load_file(str(out / "head" / "model.safetensors"))
    moved = [k for k in first if first[k].is_floating_point() and not torch.equal(first[k], last[k])]
    assert moved, "the second optimizer step changed no weight"
    assert all(v.dtype == torch.float32 for v in head.values() if v.is_floating_point()), "master weights are fp32"
    assert json.loads((out / "head" / "config.json").read_text())["target"]["name_or_path"] == str(user / folder)


@pytest.fixture(scope="module")
def heads(user, tmp_path_factory):
    """One head per recipe, trained on the bf16 folder loaded as bf16 (what `conf/target/hf.yaml` does)."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    from selfspec.train.run import release_output_dir

    root = tmp_path_factory.mktemp("heads")
    for recipe in RECIPES:
        _train(recipe, ["target=hf", f"target.name_or_path={user / 'bfloat16'}", *_data(user, "jsonl"), *TRAIN,
                        *DRAFT[recipe], f"output_dir={root / recipe}"])
        release_output_dir()
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()
    return root


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_the_head_decodes_exactly_and_benchmarks(user, heads, tmp_path, recipe):
    """fp32 greedy with the head (trained on the bf16 load) equals the target's own; bench and eval take it."""
    from selfspec.scripts import bench, eval_heads
    from selfspec.decode.engine import generate
    from selfspec.decode.generate import main as generate_main

    target_args = ["target=hf", f"target.name_or_path={user / 'bfloat16'}"]
    head = heads / recipe / "head"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("What comes after 7?", "Count on.")))
    rows = generate_main(argv=[*target_args, "target.dtype=float32", f"head={head}", f"prompts_file={prompts}",
                               f"output_file={tmp_path / 'o.jsonl'}", "max_new_tokens=24", "num_draft=3"])
    target = load_target(str(user / "bfloat16"), dtype="float32")
    for row, text in zip(rows, ("What comes after 7?", "Count on.")):
        ids = target.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                   tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        assert row["token_ids"] == generate(target, None, ids, 24).tokens

    report = bench.main(argv=[*target_args, f"head={head}", f"prompts_file={prompts}", "max_new_tokens=12",
                         "sweep_k=[]", f"methods=[target,{recipe}]", f"output_file={tmp_path / 'bench.json'}"])
    assert report["methods"][recipe]["identical"] is not None
    if recipe != "layerskip":  # eval_heads measures EAGLE-style chains
        ev = eval_heads.main(argv=[*target_args, *_data(user, "jsonl"), "data.heldout_fraction=0.1",
                                   "data.max_length=96", "prompts=2", "new_tokens=8", f"+heads.mine={head}",
                                   f"output_file={tmp_path / 'eval.json'}"])
        assert 1.0 <= ev["heads"]["mine"]["tau"] <= 4.0


EXPORTS = {"eagle": ["eagle", "speculators", "sglang"], "eagle3": ["speculators", "sglang"]}


@pytest.mark.parametrize("recipe", list(EXPORTS))
def test_the_head_exports_and_publishes(user, heads, tmp_path, recipe):
    """Every format takes the head (its safetensors keep fp32 weights), and publish's dry run writes its card. The
    head records a local folder as its target: the export reads it only when the user names it (target=)."""
    from selfspec.scripts import export, publish

    head = heads / recipe / "head"
    target_args = ["target=hf", f"target.name_or_path={user / 'bfloat16'}"]
    for fmt in EXPORTS[recipe]:
        export.main(argv=[f"head={head}", f"format={fmt}", f"out={tmp_path / fmt}", *target_args])
        weights = load_file(str(next((tmp_path / fmt).glob("*.safetensors"))))
        assert weights and all(torch.isfinite(v).all() for v in weights.values() if v.is_floating_point())
    publish.main(argv=[f"head={head}", "repo_id=me/user-head", "dry_run=true", f"out={tmp_path / 'card'}"])
    assert (tmp_path / "card" / "README.md").exists()


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_two_processes_train_on_a_bf16_target(user, tmp_path, launch2, recipe):
    """Two CPU processes (accelerate's launcher, tests/train/conftest.py): both ranks end on the same weights."""
    out = tmp_path / "mp"
    run = launch2(["-m", RECIPES[recipe], "target=hf", f"target.name_or_path={user / 'bfloat16'}",
                   *_data(user, "disk"), *TRAIN, *DRAFT[recipe], "train.eval_prompts=0", f"output_dir={out}"], ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    assert len(head_digests(run)) == 1 and (out / "head" / "model.safetensors").exists()
