"""registry.py: one entry per drafting method, and shared code that never names one. A method from a folder outside
the package registers with one `register(Method(...))` and the house builds, saves, loads, decodes and exports it
like a shipped one; the registry's fields resolve to the code they name."""

from __future__ import annotations

import textwrap

import pytest
import torch

from selfspec.core.errors import UserError
from selfspec.registry import SHIPPED, Method, method, names, register, unregister

FIELDS = ("head", "schema", "drafter", "card")

TOY = {  # a method of its own outside the package: EAGLE-1's layer under another name, its own card and export
    "__init__.py": "",
    "head.py": """
        from selfspec.methods.eagle.head import EagleConfig, build_eagle

        ToyConfig = EagleConfig


        def build(target_model, **config):
            head = build_eagle(target_model, **config)
            head.head_type = "toy"
            return head
    """,
    "drafter.py": """
        from selfspec.decode.drafters import load_head_for, vocab_size_of
        from selfspec.methods.eagle.drafter import EagleDrafter


        def build(target, head=None, num_draft=None, head_revision=None, **_):
            head = load_head_for(target, head, "toy", head_revision)
            return EagleDrafter(head, vocab_size_of(target), num_draft=num_draft)
    """,
    "card.py": """
        def section(head, target, state):
            return ["a toy head"], [("type", "`toy`")]
    """,
    "train.py": """
        \"\"\"The toy's recipe, against the shared training machinery only: EAGLE-1's loss on the toy head. Its configs
        live here too (Hydra's ConfigStore: the recipe's primary config and its `draft=toy` option), not in the
        package's conf/.\"\"\"
        from dataclasses import dataclass, field

        from hydra.core.config_store import ConfigStore
        from omegaconf import OmegaConf

        from selfspec.core.cli import entry
        from selfspec.eval.acceptance import chain_acceptance
        from selfspec.methods.eagle.train import EagleLossConfig, eagle_loss
        from selfspec.train.config import RunConfig, draft_schemas
        from selfspec.train.features import feature_model, training_data
        from selfspec.train.loop import conclude, optimizer_step, train_loop
        from selfspec.train.preamble import draft_vocab, open_run, start
        from selfspec.train.run import resume_point, run_record
        from toy_method.head import build

        ConfigStore.instance().store(name="train_toy", node={
            "defaults": ["train_toy_schema", "_self_", {"target": "smollm2-135m"}, {"data": "sharegpt"},
                         {"draft": "toy"}, {"logger": "none"}],
            "output_dir": "outputs/toy"})
        ConfigStore.instance().store(group="draft", name="toy", node={"defaults": ["toy_schema", "_self_"],
                                                                      "type": "toy"})


        @dataclass
        class TrainToyConfig(RunConfig):
            eagle: EagleLossConfig = field(default_factory=EagleLossConfig)


        @entry("train_toy", TrainToyConfig, draft_schemas())
        def main(cfg):
            accelerator, target = open_run(cfg)
            teacher = feature_model(target.model, cfg.train.features_dtype)
            train_set, token_rows = training_data(cfg.data, target, accelerator)
            record = run_record(cfg, "toy_method/train.py", target.identity, len(train_set), accelerator)
            resumed = resume_point(cfg, record, target.identity, accelerator)
            d = cfg.draft
            head = build(target.model, vocab_size=d.vocab_size,
                         draft_vocab=draft_vocab(resumed, d.vocab_size, target, token_rows))
            params = [p for p in head.parameters() if p.requires_grad]
            run, eval_seqs = start(cfg, accelerator, target, head, params, len(train_set), record, resumed)

            def step(batch):
                with accelerator.accumulate(run.head_ddp), accelerator.autocast():
                    loss, stats = eagle_loss(run.head_ddp, run.head, teacher, batch, cfg.eagle)
                    accelerator.backward(loss)
                    optimizer_step(run)
                return {"loss": stats["loss"], "acc": stats["acc"]}

            def evaluate(head):
                ev = chain_acceptance(head.eval(), target, eval_seqs, cfg.train.eval_depth)
                head.train()
                return ev

            train_loop(run, train_set, target.tokenizer.pad_token_id or 0, step, evaluate)
            training = {"recipe": "toy_method/train.py", "train": OmegaConf.to_container(cfg.train)}
            return conclude(run, evaluate if eval_seqs else None, lambda ev: f"tau {ev['tau']:.3f}", token_rows,
                            target.identity, training)
    """,
    "formats.py": """
        from selfspec.methods.eagle.formats import read_back, to_eagle

        EXPORTERS = {"eagle": to_eagle}
        IMPORTERS = {}
    """,
}


@pytest.fixture
def toy(tmp_path, monkeypatch):
    folder = tmp_path / "toy_method"
    folder.mkdir()
    for name, text in TOY.items():
        (folder / name).write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    m = register(Method(name="toy", title="Toy", head="toy_method.head:build", schema="toy_method.head:ToyConfig",
                        drafter="toy_method.drafter:build", card="toy_method.card",
                        formats="toy_method.formats", hybrid="chain", recipe="toy_method.train",
                        tiny=("draft.vocab_size=64",)))
    yield m
    unregister("toy")


def test_every_shipped_method_names_code_that_exists():
    assert names()[:len(SHIPPED)] == SHIPPED == ("eagle", "eagle3", "layerskip", "dflash", "peagle", "dspark")
    for name in SHIPPED:
        m = method(name)
        for field in FIELDS + (("formats",) if m.formats else ()):
            assert m.load(field) is not None, (name, field)


def test_the_registry_refuses_a_taken_name_and_an_unknown_one():
    with pytest.raises(ValueError, match="already registered"):
        register(Method(name="eagle", title="x", head="a:b", schema="a:b", drafter="a:b", card="a:b"))
    with pytest.raises(ValueError, match="ships with selfspec"):
        unregister("eagle")
    with pytest.raises(UserError, match="unknown head type 'nope'; known: eagle, eagle3"):
        method("nope")


def test_a_method_from_a_folder_outside_the_package_trains_with_the_shared_loop(toy, tmp_path):
    """Its own recipe, run as every recipe's tiny training (train/tiny.py: the registry's `recipe` and `tiny`), 2
    optimizer steps on a tiny Llama: a head folder of type toy that decodes losslessly."""
    from selfspec.decode.drafters import build_drafter
    from selfspec.decode.engine import generate
    from selfspec.heads.checkpoint import read_head
    from selfspec.target.model import load_target
    from selfspec.target.tiny import build_tiny_target
    from selfspec.train.tiny import train_head

    folder = tmp_path / "target"
    for part in build_tiny_target("llama"):
        part.save_pretrained(folder)
    out = train_head(folder, "toy", tmp_path / "run")
    record, state = read_head(str(out))
    assert record["head"]["type"] == "toy" and record["training"]["recipe"] == "toy_method/train.py"
    assert record["training"]["steps"] == 2 and state["draft_vocab"].numel() == 64  # 2 steps, its own draft vocabulary

    target = load_target(str(folder))
    prompt = torch.arange(3, 15)
    plain = generate(target, None, prompt, max_new_tokens=30)
    drafted = generate(target, build_drafter("toy", target, head=str(out), num_draft=3), prompt, max_new_tokens=30)
    assert drafted.tokens == plain.tokens and drafted.drafted_tokens > 0


def test_a_method_from_a_folder_outside_the_package_decodes_losslessly_and_exports(toy, tmp_path):
    from selfspec.target.model import load_target
    from selfspec.decode.drafters import build_drafter, drafter_for
    from selfspec.decode.engine import generate
    from selfspec.heads.checkpoint import head_record, load_head, read_head, save_head
    from selfspec.publish.card import model_card
    from selfspec.publish.export import convert, read_export, write_export
    from selfspec.train.config import draft_schemas

    target = load_target("tiny:llama")
    torch.manual_seed(0)
    head = toy.load("head")(target.model)
    folder = save_head(head, tmp_path / "head", head_record(head, target.identity))
    assert load_head(str(folder), target).head_type == "toy"
    assert drafter_for(None, str(folder)) == "toy"  # the head's recorded type picks its drafter
    assert draft_schemas()["draft"]["toy_schema"].__name__ == "EagleConfig"

    prompt = torch.arange(3, 15)
    plain = generate(target, None, prompt, max_new_tokens=40)
    drafted = generate(target, build_drafter("toy", target, head=str(folder), num_draft=4), prompt, max_new_tokens=40)
    assert drafted.tokens == plain.tokens and drafted.drafted_tokens > 0  # lossless, and it drafted

    record, state = read_head(str(folder))
    out = write_export(convert(record, state, target.model.config, "eagle"), record, tmp_path / "export")
    back_record, back = read_export(out)
    stub = "model.embed_tokens.weight"  # EAGLE-1's unused 1-row embedding: never exported, read back as zeros
    assert back_record["head"]["type"] == "toy" and set(back) == set(state)
    assert all(torch.equal(back[k], state[k]) for k in state if k != stub)
    with pytest.raises(UserError, match="format=speculators does not know head type 'toy'"):
        convert(record, state, target.model.config, "speculators")
    assert "A Toy draft head" in model_card(record, "me/toy", state) and "a toy head" in model_card(
        record, "me/toy", state)
