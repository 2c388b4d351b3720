"""Shared by every test: the test-only drafters (`oracle`, `always_wrong`, tests/harness/drafters.py) join the
drafter registry, so tests build them with `build_drafter("oracle", target, ...)` like any other drafter.
Under pytest-xdist (`make test` runs one worker per core) each worker takes its share of the cores for torch, so
the workers do not oversubscribe the machine."""

import gc
import os
import sys
from pathlib import Path

import pytest

# Python's cyclic collector, at its defaults, runs a full pass every 70,000 net allocations or so once enough objects
# have survived, and a pass here walks everything a test process holds (torch, transformers and the suite's pooled
# models: 0.3-0.7 s each): 20-45 s of a `make test` worker's time. With a first generation 70x larger every cycle is
# still collected, in passes 70x rarer (a worker's collector time 16-30 s -> 5-7 s, measured 2026-11-30 with
# gc.callbacks). The processes the tests start keep Python's defaults.
gc.set_threshold(50_000, 10, 10)

import isa_probe  # noqa: E402


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the xdist controller, or a run without xdist: the summary's probe, begun
        config._isa_probe = isa_probe.start(check=False)  # now so that it runs beside the tests (_isa_line)
    if _xdist_controller(config):  # it runs no test: no torch to import before the workers start
        return
    from harness.drafters import register_test_drafters

    register_test_drafters()
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))



@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """After every test: a recipe run in-process (tests/train, and any test that trains a head to use it, e.g.
    tests/data/test_vllm_features.py) leaves accelerate's process singletons initialised, with its mixed precision,
    and its output_dir locked; the next test in the same worker starts from none of that."""
    yield
    if "accelerate.state" not in sys.modules:  # nothing to reset (and no import to pay for)
        return
    from accelerate.state import AcceleratorState, GradientState, PartialState

    from selfspec.train.run import release_output_dir

    release_output_dir()  # a recipe that stopped on an error still holds its output_dir's lock
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()

# The files that keep a worker half a minute or more (`make test PYTEST_ARGS=--durations=120`, 2026-11-26, 2 cores),
# longest first. xdist's loadfile hands out whole files in collection order (`make test` passes
# --no-loadscope-reorder; its default order is by test count, which put the one-test fault-injection file last), so
# these start first and the two workers end together instead of one finishing a long file alone.
LONG_FILES = ("reliability/test_fuzz_lossless.py", "reliability/test_bad_inputs.py", "train/test_fsdp.py",
              "decode/test_shipped_head.py", "publish/test_export_dflash.py", "core/test_target.py",
              "test_install.py", "decode/test_sampling_exact.py", "reliability/test_kill_resume.py",
              "data/test_vllm_features.py", "train/test_run_safety.py", "reliability/test_fault_injection.py",
              "reliability/test_sampling_extra.py", "train/test_user_target.py")


# The files whose results depend on which GEMM kernels the CPU runs (oneDNN's packed inner product, MKL's sgemm, each
# dispatching on the instruction set): packed kernels, head round trips through exports and imports, lossless decoding
# and its fuzz, the argmax screen, hidden states from another engine. They get the `kernels` marker (so do single tests
# elsewhere that compare two kernel paths, marked where they stand; tests/tolerance.py bounds them), and `make test`
# runs them again with oneDNN and MKL capped at lower instruction sets (Makefile ISA_CAPS), so a path another CPU takes
# is a path CI took.
KERNEL_FILES = ("core/test_kernels.py", "core/test_avx2.py", "heads/test_checkpoint.py", "heads/test_eagle_head.py",
                "heads/test_eagle3_head.py", "heads/test_dflash_head.py", "heads/test_layerskip_head.py",
                "heads/test_peagle_head.py", "heads/test_head_layers.py", "decode/test_peagle_decode.py",
                "publish/test_export.py", "publish/test_export_dflash.py", "publish/test_import.py",
                "publish/test_publish.py", "decode/test_engine_lossless.py", "decode/test_screened_argmax.py",
                "decode/test_dflash_decode.py", "decode/test_layerskip_decode.py", "decode/test_dynamic_chain.py",
                "decode/test_vocab_mapping.py", "reliability/test_fuzz_lossless.py", "data/test_vllm_features.py")


def pytest_ignore_collect(collection_path, config):
    """Under `-m kernels` alone (make test's capped reruns), a test file that is not in KERNEL_FILES and never names
    the marker holds no test the run would select: it is not imported (collecting every file costs each worker
    seconds per rerun). The selection is the same: a test gets the marker from KERNEL_FILES or where it stands."""
    if config.getoption("markexpr", "") != "kernels" or collection_path.suffix != ".py":
        return None
    name = collection_path.name
    if not (name.startswith("test_") or name.endswith("_test.py")):
        return None
    rel = _relative(collection_path)
    if not rel or rel in KERNEL_FILES or "kernels" in collection_path.read_text(encoding="utf-8"):
        return None  # a file outside tests/ (pytest decides), or one that may hold a kernel-marked test
    return True


TESTS = Path(__file__).resolve().parent


def _relative(path) -> str:
    """A test file's path below tests/, "" for one outside it (pytest given another path)."""
    try:
        return Path(str(path)).resolve().relative_to(TESTS).as_posix()
    except ValueError:
        return ""


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    for item in items:
        if _relative(item.fspath) in KERNEL_FILES:
            item.add_marker("kernels")
    items.sort(key=lambda item: rank.get(_relative(item.fspath), len(LONG_FILES)))  # stable otherwise


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The run's last lines say which instruction sets its kernels took (`make test` runs the suite more than once)."""
    if not hasattr(config, "workerinput"):  # the xdist controller, or a run without xdist
        terminalreporter.write_line(_isa_line(config))


def _xdist_controller(config) -> bool:
    """The process that hands tests to xdist's workers (`-n N`, N > 0)."""
    return not hasattr(config, "workerinput") and bool(getattr(config.option, "numprocesses", None))


def _isa_line(config) -> str:
    """The CPU, oneDNN's ISA as oneDNN reports it, and the caps asked for (MKL reports no ISA:
    MKL_ENABLE_INSTRUCTIONS is a ceiling, and MKL takes its AVX2 path on AMD CPUs)."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU") if Path("/proc/cpuinfo").exists() else "unknown CPU"
    flags = next((set(line.split(":", 1)[1].split()) for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), set()) if Path("/proc/cpuinfo").exists() else set()
    best = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16") if f in flags]
    isa = config._isa_probe()[0]  # tests/isa_probe.py: what `make test` compares its capped reruns by
    caps = ", ".join(f"{k}={os.environ[k]}" for k in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
                     if k in os.environ) or "none (the host's best)"
    return f"kernels: {cpu} ({' '.join(best) or 'no AVX2'}); oneDNN isa: {isa}; caps: {caps}"
