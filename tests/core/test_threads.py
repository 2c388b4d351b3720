"""core/threads.py: torch's threads follow the cores other jobs leave free, and come back when they leave."""

from __future__ import annotations

import pytest
import torch

from selfspec.core import threads


@pytest.fixture
def machine(monkeypatch):
    """A scripted machine: `state` holds the machine's busy CPU seconds, this process's own and the clock."""
    state = {"busy": 0.0, "own": 0.0, "now": 0.0}
    monkeypatch.setattr(threads, "_machine_busy_s", lambda: state["busy"])
    monkeypatch.setattr(threads.time, "process_time", lambda: state["own"])
    monkeypatch.setattr(threads.time, "monotonic", lambda: state["now"])
    monkeypatch.setattr(threads, "cores", lambda: 2)
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    yield state
    torch.set_num_threads(old)


def _advance(state, seconds: float, own_cores: float, other_cores: float) -> None:
    state["now"] += seconds
    state["own"] += own_cores * seconds
    state["busy"] += (own_cores + other_cores) * seconds


def test_alone_keeps_every_thread_and_a_busy_machine_gets_one(machine):
    gov = threads.Governor(interval=0.25)
    with gov:
        _advance(machine, 0.3, own_cores=2.0, other_cores=0.05)  # alone: kernel threads, a shell
        gov.tick()
        assert torch.get_num_threads() == 2 and gov.changes == 0
        _advance(machine, 0.3, own_cores=1.0, other_cores=1.9)  # a 2-thread job arrived: we got one core's worth
        gov.tick()
        assert torch.get_num_threads() == 1
        _advance(machine, 0.1, own_cores=1.0, other_cores=0.0)  # inside the interval: no look
        gov.tick()
        assert torch.get_num_threads() == 1
        _advance(machine, 0.3, own_cores=1.0, other_cores=0.1)  # the job left
        gov.tick()
        assert torch.get_num_threads() == 2 and gov.changes == 2


def test_a_run_starts_at_the_last_decision_and_gives_the_callers_count_back(machine):
    gov = threads.Governor(interval=0.25)
    with gov:
        _advance(machine, 0.3, own_cores=1.0, other_cores=1.5)
        gov.tick()
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2  # the caller's own count outside a run
    with gov:
        assert torch.get_num_threads() == 1  # the machine was busy a moment ago


def test_fixed_threads_never_move(machine, monkeypatch):
    monkeypatch.setenv("SELFSPEC_THREADS", "fixed")
    monkeypatch.setattr(threads, "_GOVERNOR", None)
    gov = threads.governor()
    with gov:
        _advance(machine, 0.3, own_cores=1.0, other_cores=2.0)
        gov.tick()
        assert torch.get_num_threads() == 2 and not gov.enabled


def test_the_real_machine_reading_is_cpu_seconds():
    busy = threads._machine_busy_s()
    if busy is None:
        pytest.skip("no /proc/stat on this system: the governor is off here")
    x = 0
    for i in range(2_000_000):  # some CPU time of our own
        x += i
    assert threads._machine_busy_s() > busy
