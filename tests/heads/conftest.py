"""Fixtures the head tests share: the tiny Llama target."""

import pytest

from selfspec.target.model import load_target


@pytest.fixture(scope="module")
def target():
    return load_target("tiny:llama")
