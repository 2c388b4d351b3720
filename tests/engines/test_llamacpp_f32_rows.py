"""scripts/llamacpp-f32-invariant.patch and scripts/llamacpp-sgemm-narrow.patch in make llamacpp's ggml: every output
of an F32 product of n rows (a verification pass of n - 1 drafts) has the bits of the same row's product alone (a
decode step), for n = 1..12 and 1 or 2 threads, at each of SmolLM2-135M's product shapes; and every query row of
attention over n causal rows has the bits of that row's attention alone, over 768 and 2048 cached positions (past the
512 where llama.cpp split one query's positions over the threads), at SmolLM2-135M's heads (9 over 3 KV heads of 64)
and Qwen2.5-1.5B's (12 over 2 of 128). So a greedy F32 row leaves plain llama.cpp at no near-tie these ops decide
(docs/hybrid.md, "Why a llama.cpp F32 row can leave plain at a near-tie"). Compiles tests/engines/llamacpp_f32_rows.c
and llamacpp_attn_rows.c against the build's static ggml; without a build (or a C compiler) it skips in one line.
Marked `llamacpp_server`: make check-llamacpp runs it."""

import shutil
import subprocess
from pathlib import Path

import pytest

from llamacpp_converter import server_binary

pytestmark = pytest.mark.llamacpp_server

SOURCE = Path(__file__).with_name("llamacpp_f32_rows.c")
ATTENTION = Path(__file__).with_name("llamacpp_attn_rows.c")
SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536)]  # q/o, k/v, gate/up, down: (rows of A, k)


def _built(tmp_path: Path, source: Path = SOURCE) -> Path:
    build = Path(server_binary()).resolve().parents[1]
    libs = [build / "ggml" / "src" / f"libggml{part}.a" for part in ("", "-cpu", "-base")]
    include = build.parent / "llama.cpp" / "ggml" / "include"
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None or not all(p.is_file() for p in libs) or not (include / "ggml.h").is_file():
        pytest.skip(f"no C compiler or no static ggml at {build} (make llamacpp builds it)")
    exe = tmp_path / source.stem
    out = subprocess.run([cc, "-O2", f"-I{include}", str(source), *map(str, libs), "-lstdc++", "-lm", "-lpthread",
                          "-fopenmp", "-o", str(exe)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    return exe


def test_every_f32_row_of_a_product_has_its_one_row_products_bits(tmp_path):
    exe = _built(tmp_path)
    for m, k in SHAPES:
        out = subprocess.run([str(exe), str(m), str(k), "12"], capture_output=True, text=True, timeout=600)
        lines = out.stdout.splitlines()
        assert len(lines) == 24 and out.returncode == 0, (m, k, out.stdout[-3000:], out.stderr[-1000:])
        assert all(" 0 of " in line for line in lines), (m, k, [line for line in lines if " 0 of " not in line])


def test_every_query_row_of_attention_has_its_one_query_bits(tmp_path):
    exe = _built(tmp_path, ATTENTION)
    for heads, kv_heads, dim in ((9, 3, 64), (12, 2, 128)):
        for cache in (768, 2048):
            args = [str(exe), str(heads), str(kv_heads), str(dim), str(cache), "12"]
            out = subprocess.run(args, capture_output=True, text=True, timeout=600)
            lines = out.stdout.splitlines()
            assert len(lines) == 24 and out.returncode == 0, (args, out.stdout[-3000:], out.stderr[-1000:])
            assert all(" 0 of " in line for line in lines), (args, [line for line in lines if " 0 of " not in line])
