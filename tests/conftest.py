"""Shared by every test: the test-only drafters (`oracle`, `always_wrong`, tests/harness/drafters.py) join the
drafter registry, so tests build them with `build_drafter("oracle", target, ...)` like any other drafter.
Under pytest-xdist (`make test` runs one worker per core) each worker takes its share of the cores for torch, so
the workers do not oversubscribe the machine."""

import os

from harness.drafters import register_test_drafters


def pytest_configure(config):
    register_test_drafters()
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
