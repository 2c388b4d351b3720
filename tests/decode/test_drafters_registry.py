"""decode/drafters/__init__.py: import failures say what is really missing."""

from __future__ import annotations

import sys

import pytest

from selfspec.decode.drafters import load_head_for
from selfspec.core.errors import UserError


def test_missing_checkpoint_module_is_reported_as_missing(monkeypatch):
    # import heads.checkpoint -> ModuleNotFoundError
    monkeypatch.setitem(sys.modules, "selfspec.heads.checkpoint", None)
    with pytest.raises(UserError, match="heads/checkpoint.py is missing"):
        load_head_for(object(), "some/head", "eagle")


def test_a_missing_dependency_keeps_its_real_name(monkeypatch):
    monkeypatch.delitem(sys.modules, "selfspec.heads.checkpoint", raising=False)  # re-imported below, restored after
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)  # a dependency of heads.checkpoint
    with pytest.raises(ImportError) as e:
        load_head_for(object(), "some/head", "eagle")
    assert not isinstance(e.value, UserError) and "missing" not in str(e.value).replace("No module", "")
    assert e.value.name == "safetensors.torch"


def test_register_refuses_a_name_another_builder_holds():
    from selfspec.decode import drafters

    with pytest.raises(ValueError, match="already registered"):
        drafters.register("ngram", lambda target, **_: None)
    drafters.register("ngram", drafters.DRAFTERS["ngram"])  # the same builder again is a no-op


def test_production_registry_knows_no_test_drafter():
    """conftest registers the test drafters in every session, so read what the package itself registers."""
    import subprocess
    import sys

    code = "from selfspec.decode.drafters import DRAFTERS; print(sorted(DRAFTERS))"
    names = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "oracle" not in names and "always_wrong" not in names and "ngram" in names
