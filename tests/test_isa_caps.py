"""`make test`'s capped reruns (Makefile test-isa): after the full run, a cap under which oneDNN and MKL take the very
kernels of that run (tests/isa_probe.py) is not run again; every other cap is."""

import subprocess
from pathlib import Path

from isa_probe import kernels

ROOT = Path(__file__).resolve().parents[1]


def test_after_the_full_run_only_a_cap_that_repeats_its_kernels_is_skipped(monkeypatch):
    # oneDNN takes a name it does not know as no cap at all (Makefile, ISA_BASE's comment), MKL likewise: NOCAP gets
    # the uncapped kernels; SSE41 is below every host's best. --collect-only: the reruns' selection, not their tests.
    caps = "SSE41:SSE4_2 NOCAP:NONE"
    res = subprocess.run(["make", "-s", "--no-print-directory", "test-isa", "AFTER_FULL_RUN=1", f"ISA_CAPS={caps}",
                          "XDIST=", "PYTEST_ARGS=--collect-only -q"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "== kernel-sensitive tests, oneDNN capped at SSE41, MKL at SSE4_2" in res.stdout
    uncapped = kernels()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "NOCAP")
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "NOCAP")
    if kernels() == uncapped:  # the uncapped kernels (as on every CPU we know): skipped
        assert "== NOCAP: the full run above took these kernels already (oneDNN " in res.stdout
        assert "capped at NOCAP" not in res.stdout
    else:  # a library that reads the unknown name as a cap after all: run
        assert "== kernel-sensitive tests, oneDNN capped at NOCAP" in res.stdout
