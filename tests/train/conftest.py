"""Recipes run in-process here: each test starts from a fresh accelerate state (it is a process singleton) and
holds no output_dir lock."""

import pytest


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    from accelerate.state import AcceleratorState, GradientState, PartialState

    from selfspec.train.common import release_output_dir

    yield
    release_output_dir()  # a recipe that stopped on an error still holds its output_dir's lock
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()
