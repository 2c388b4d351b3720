"""Shared by every test: the test-only drafters (`oracle`, `always_wrong`, tests/harness/drafters.py) join the
drafter registry, so tests build them with `build_drafter("oracle", target, ...)` like any other drafter."""

from harness.drafters import register_test_drafters


def pytest_configure(config):
    register_test_drafters()
