"""Threads that make way for a busy CPU. torch's OpenMP workers meet at a barrier after every parallel op; when
another job holds one of the cores, the thread that reached the barrier first spins until the descheduled one is
run again, and a decode step of many small ops (a packed linear each, decode/argmax's screen) takes its whole time
slice per op: 20.8 tok/s alone, 0.7 tok/s beside a 2-thread torch job (issue 63). A passive wait policy fixes the
collapse but costs 20-30 % alone.

`Governor.tick()`, called between steps (a decode pass, an optimizer step), looks at most every `interval` seconds
at how much CPU the rest of the machine took since its last look (/proc/stat's busy time less this process's own)
and runs torch with the cores left over, at least one, at most what it started with: alone nothing changes (a read
of /proc/stat every quarter second), beside a job it runs single-threaded, with no barrier to spin at, on the core
the scheduler gives it, and takes the cores back once the job leaves. Linux only (elsewhere a no-op).
SELFSPEC_THREADS=fixed keeps torch's thread count as set."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

import torch

_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _machine_busy_s() -> Optional[float]:
    """CPU seconds every process has spent running (user, nice, system, irq, softirq, steal), or None."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != b"cpu":
        return None
    ticks = [int(x) for x in fields[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    guest = sum(ticks[8:10]) if len(ticks) > 9 else 0  # already counted in user/nice
    return (sum(ticks) - idle - guest) / _HZ


def machine() -> str:
    """The CPU this runs on, as the kernel names it (speeds move between hosts), e.g. 'AMD EPYC ..., 2 CPUs'."""
    try:
        names = [ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                 if ln.startswith("model name")]
    except OSError:
        names = []
    return f"{names[0] if names else 'unknown CPU'}, {os.cpu_count()} CPUs"


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


class Governor:
    """torch's intra-op threads sized to the cores the rest of the machine leaves free (see the module docstring)."""

    def __init__(self, interval: float = 0.25, busy: float = 0.5, enabled: bool = True):
        """interval: seconds between looks; busy: how much of a core the other jobs must take (on average over the
        interval) before a core is given up to them."""
        self.interval, self.busy = interval, busy
        self.max_threads = torch.get_num_threads()
        self.cores = cores()
        self.enabled = enabled and self.max_threads > 1 and _machine_busy_s() is not None
        self.changes = 0  # how often the thread count moved (reported by the benchmarks)
        self._threads = self._outside = self.max_threads
        self._mark()

    def _mark(self) -> None:
        self._t, self._machine, self._own = time.monotonic(), _machine_busy_s(), time.process_time()

    def tick(self) -> None:
        if not self.enabled or time.monotonic() - self._t < self.interval:
            return
        t, machine, own = self._t, self._machine, self._own
        self._mark()
        wall = self._t - t
        if self._machine is None or machine is None or wall <= 0:
            return
        others = max(0.0, (self._machine - machine) - (self._own - own)) / wall  # cores the other jobs used
        free = self.cores - others + (1.0 - self.busy)  # a core counts as taken once `busy` of it is
        threads = max(1, min(self.max_threads, int(free)))
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
            self.changes += 1

    def __enter__(self) -> "Governor":
        """A decode or a training run starts: torch gets the thread count last decided (the machine is likely as
        busy as it was a moment ago); the first tick corrects it."""
        self._outside = torch.get_num_threads()
        if self.enabled and self._threads != self._outside:
            torch.set_num_threads(self._threads)
        self._mark()
        return self

    def __exit__(self, *exc) -> None:
        """...and ends: the caller's own thread count back."""
        self._threads = torch.get_num_threads()
        if self._threads != self._outside:
            torch.set_num_threads(self._outside)


_GOVERNOR: Optional[Governor] = None


def governor() -> Governor:
    """The process's governor (SELFSPEC_THREADS=fixed turns it off: torch keeps its thread count whatever the load).
    Made on first use with torch's thread count then as its most; a later torch.set_num_threads above that raises
    it."""
    global _GOVERNOR
    n = torch.get_num_threads()
    if _GOVERNOR is None or n > _GOVERNOR.max_threads:
        _GOVERNOR = Governor(enabled=os.environ.get("SELFSPEC_THREADS", "adaptive") != "fixed")
    return _GOVERNOR
