"""scripts/export.py takes the target whose config it copies from the user, never from a path the head records
(issue 47): a head recorded for a local folder is refused in one line without `target=`, exported with it, and the
export names the target given as its verifier; a head recorded for a name (tiny:, a Hub id) needs nothing."""

from __future__ import annotations

import json

import pytest

from selfspec.target.model import load_target
from selfspec.heads.checkpoint import head_record, save_head
from selfspec.methods.eagle.head import build_eagle
from selfspec.scripts import export as export_script


@pytest.fixture(scope="module")
def target():
    return load_target("tiny:llama")


def _head(tmp_path, target, name_or_path: str):
    """An EAGLE head of tiny-llama whose record names `name_or_path` as its target."""
    head = build_eagle(target.model)
    save_head(head, tmp_path / "h", head_record(head, {**target.identity, "name_or_path": name_or_path}))
    return tmp_path / "h"


def test_a_recorded_folder_is_never_read_the_target_given_is(tmp_path, target, capsys):
    model = tmp_path / "model"
    target.model.config.save_pretrained(model)  # a real model folder: the export would read its config
    head = _head(tmp_path, target, str(model))
    with pytest.raises(SystemExit) as e:
        export_script.main([f"head={head}", "format=speculators", f"out={tmp_path / 'a'}"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "target.name_or_path=" in err, err
    assert not (tmp_path / "a").exists()

    given = tmp_path / "same-model"
    target.model.config.save_pretrained(given)
    export_script.main([f"head={head}", "format=speculators", f"out={tmp_path / 'b'}", "target=hf",
                        f"target.name_or_path={given}"])
    assert json.loads((tmp_path / "b" / "config.json").read_text())["speculators_config"]["verifier"][
        "name_or_path"] == str(given)
    assert json.loads((tmp_path / "b" / "selfspec.json").read_text())["target"]["name_or_path"] == str(given)


def test_the_target_given_must_fit_the_head(tmp_path, target, capsys):
    head = _head(tmp_path, target, "/nowhere/model")
    with pytest.raises(SystemExit) as e:
        export_script.main([f"head={head}", "format=speculators", f"out={tmp_path / 'a'}", "target=tiny-llama",
                            "+target.tiny.hidden_size=32"])
    assert e.value.code == 2 and "hidden_size=32" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()


def test_a_recorded_name_needs_no_target(tmp_path, target):
    head = _head(tmp_path, target, "tiny:llama")
    result = export_script.main([f"head={head}", "format=speculators", f"out={tmp_path / 'a'}"])
    assert "model.safetensors" in result["files"]
