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
                        formats="toy_method.formats", hybrid="chain"))
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
