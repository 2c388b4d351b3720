"""scripts/build_llamacpp.sh's fallback flags, read from a CPU's /proc/cpuinfo flags (no build: `make llamacpp` builds,
smoke-tests and keeps one; issue 47)."""

import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "build_llamacpp.sh"
BASE = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c bmi1 bmi2"
AVX512 = "avx512f avx512dq avx512cd avx512bw avx512vl"
# Sapphire Rapids (the AMX Xeon of issue 47) and the AMD EPYC CI runs on, as their flags lines read
SAPPHIRE_RAPIDS = f"{BASE} avx_vnni {AVX512} avx512vbmi avx512_vnni avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8"
EPYC = f"{BASE} {AVX512} avx512ifma avx512vbmi avx512_vbmi2 avx512_vnni avx512_bf16"


def flags(cpu: str) -> dict[str, str]:
    out = subprocess.run(["bash", str(SCRIPT), "--portable-flags", cpu], capture_output=True, text=True, check=True)
    return dict(f.removeprefix("-DGGML_").split("=") for f in out.stdout.split())


@pytest.mark.parametrize("cpu", [SAPPHIRE_RAPIDS, EPYC])
def test_an_avx512_host_gets_its_avx512_sets_and_never_amx(cpu):
    got = flags(cpu)
    assert got["NATIVE"] == "OFF" and {got[k] for k in ("AMX_TILE", "AMX_INT8", "AMX_BF16")} == {"OFF"}
    assert all(got[k] == "ON" for k in ("AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16", "AVX2", "FMA", "F16C"))
    assert got["AVX_VNNI"] == ("ON" if "avx_vnni" in cpu.split() else "OFF")


def test_an_avx2_host_gets_no_avx512():
    got = flags(BASE)
    assert got["AVX2"] == got["FMA"] == got["F16C"] == got["BMI2"] == "ON"
    assert {got[k] for k in ("AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16", "AVX_VNNI")} == {"OFF"}


def test_avx512_needs_every_set_its_compile_flags_name():
    """ggml compiles GGML_AVX512 with -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw: with one missing (Xeon
    Phi has no avx512bw/vl) neither it nor an AVX-512 extension is assumed."""
    got = flags(f"{BASE} avx512f avx512cd avx512er avx512_vnni")
    assert got["AVX512"] == got["AVX512_VNNI"] == "OFF" and got["AVX2"] == "ON"
    assert flags("sse4_2")["AVX"] == flags("sse4_2")["AVX2"] == "OFF"
