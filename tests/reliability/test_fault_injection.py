"""Fault injection, quick version: regenerate.py and cache_features.py SIGKILLed once while writing their output,
export.py and publish.py dry_run=true twice (into a new folder, then over an earlier export / staged repo), with
their writes slowed so that the kills land between them; then run again to the end: no file left corrupt or
incomplete, no temp file left over, and the result equals an uninterrupted run's. Training's kills are
tests/reliability/test_kill_resume.py; the long campaign is `python tests/run_harness.py fault_injection` (all five
entry points, several kills each)."""

from __future__ import annotations

import os

from harness import fault_injection as fi
from harness.warm_python import WarmPython, map_warm


def test_killed_writers_leave_no_corrupt_file_and_finish_identical(tmp_path):
    # every launch is a child of a warm Python (imports paid once per worker, not 14 times; the slowed writes
    # reach selfspec's own references too): a real process, SIGKILLed like a fresh one
    pythons = [WarmPython({**os.environ, "HF_HUB_OFFLINE": "1"}) for _ in range(2)]
    cfg = fi.FaultInjectionConfig(conversations=4)
    eps = fi.entry_points(cfg, fi._fixture_head(tmp_path / "fixtures"))
    plan = {"regenerate": 1, "cache_features": 1, "export": 2, "publish": 2}  # kills each

    def one(name: str, python: WarmPython):
        return fi.campaign(eps[name], tmp_path / name, plan[name], seed=0, modes=["write"], pause=0.2, timeout=240,
                           warm=python)

    try:
        rows = map_warm(one, plan, pythons)
    finally:
        for python in pythons:
            python.close()
    table = fi.table(rows)
    for name, r in zip(plan, rows):
        assert not r.problems, f"{r.entry_point}: {r.problems}\n{table}"
        assert r.identical and not r.corrupt, table
        assert not r.leftovers, f"{r.entry_point} left {r.leftovers}\n{table}"
    assert sum(r.kills for r in rows) >= 4, table  # most launches were killed (not finished before their kill)
