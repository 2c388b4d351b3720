"""Recipes run in-process here: each test starts from a fresh accelerate state (it is a process singleton)."""

import pytest


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    from accelerate.state import AcceleratorState, GradientState, PartialState

    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()
