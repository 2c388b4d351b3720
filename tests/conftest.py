"""Shared by every test: the test-only drafters (`oracle`, `always_wrong`, tests/harness/drafters.py) join the
drafter registry, so tests build them with `build_drafter("oracle", target, ...)` like any other drafter.
Under pytest-xdist (`make test` runs one worker per core) each worker takes its share of the cores for torch, so
the workers do not oversubscribe the machine."""

import os
from pathlib import Path

from harness.drafters import register_test_drafters


def pytest_configure(config):
    register_test_drafters()
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


# The files that keep a worker half a minute or more (`make test PYTEST_ARGS=--durations=120`, 2026-11-26, 2 cores),
# longest first. xdist's loadfile hands out whole files in collection order (`make test` passes
# --no-loadscope-reorder; its default order is by test count, which put the one-test fault-injection file last), so
# these start first and the two workers end together instead of one finishing a long file alone.
LONG_FILES = ("reliability/test_fuzz_lossless.py", "reliability/test_bad_inputs.py", "train/test_fsdp.py",
              "decode/test_shipped_head.py", "publish/test_export_dflash.py", "core/test_target.py",
              "test_install.py", "decode/test_sampling_exact.py", "reliability/test_kill_resume.py",
              "data/test_vllm_features.py", "train/test_run_safety.py", "reliability/test_fault_injection.py",
              "reliability/test_sampling_extra.py", "train/test_user_target.py")


def pytest_collection_modifyitems(config, items):
    tests = Path(__file__).resolve().parent
    rank = {name: i for i, name in enumerate(LONG_FILES)}

    def order(item) -> int:
        try:
            return rank.get(Path(str(item.fspath)).resolve().relative_to(tests).as_posix(), len(LONG_FILES))
        except ValueError:  # a test outside tests/ (pytest given another path)
            return len(LONG_FILES)

    items.sort(key=order)  # stable: within a file, and among the other files, collection order stays
