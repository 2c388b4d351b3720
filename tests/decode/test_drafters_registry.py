"""decode/drafters/__init__.py: import failures say what is really missing."""

from __future__ import annotations

import sys

import pytest

from decode.drafters import load_head_for
from heads.errors import UserError


def test_missing_checkpoint_module_is_reported_as_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "heads.checkpoint", None)  # import heads.checkpoint -> ModuleNotFoundError
    with pytest.raises(UserError, match="heads/checkpoint.py is missing"):
        load_head_for(object(), "some/head", "eagle")


def test_a_missing_dependency_keeps_its_real_name(monkeypatch):
    monkeypatch.delitem(sys.modules, "heads.checkpoint", raising=False)  # re-imported below, restored after
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)  # a dependency of heads.checkpoint
    with pytest.raises(ImportError) as e:
        load_head_for(object(), "some/head", "eagle")
    assert not isinstance(e.value, UserError) and "missing" not in str(e.value).replace("No module", "")
    assert e.value.name == "safetensors.torch"
