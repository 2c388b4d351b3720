"""Recipes run in-process here: each test starts from a fresh accelerate state (it is a process singleton) and
holds no output_dir lock. Two-process runs go through `launch2` (harness/two_ranks.py: accelerate's own test
launcher in a fork of a warm Python, the same head as `accelerate launch` in a tenth of the time)."""

import functools
import os

import pytest


@pytest.fixture(scope="session")
def warm_python():
    from harness.warm_python import WarmPython

    python = WarmPython(dict(os.environ, HF_HUB_OFFLINE="1"))
    yield python
    python.close()


@pytest.fixture
def launch2(warm_python):
    """launch2([script.py | -m module, *args], cwd) -> CompletedProcess: the entry point on two CPU processes."""
    from harness.two_ranks import fast_launch

    return functools.partial(fast_launch, warm_python)


@pytest.fixture(scope="module")
def llama4():
    """The tiny Llama target with 4 layers."""
    from selfspec.target.model import load_target

    return load_target("tiny:llama", tiny={"num_hidden_layers": 4})
