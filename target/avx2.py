"""An fp32 linear for a few rows at once, near the memory bound on an AVX2 or AVX-512 CPU: our own kernel, built on
first use.

A decoding step of a small target on a CPU is its linear layers streaming their weights; a verification pass does the
same over a few rows. Neither MKL's sgemm nor oneDNN's packed inner product overlaps that stream with the arithmetic
of more than one row (docs/cost_model.md): on a 2-vCPU AVX2 AMD EPYC (2026-12-04, best of 25), 40 weights [1536 x
576] took oneDNN 8.3 / 9.3 / 10.7 / 11.4 / 11.9 / 12.1 ms at 1 / 3 / 4 / 6 / 7 / 8 rows, and this kernel 4.7 / 5.4 /
5.0 / 5.0 / 6.8 / 6.7 (30 GB/s at one row, 85 GFLOP/s at six: from seven rows, two groups, the arithmetic shows). It
is the textbook register-blocked micro-kernel: each weight is packed once into blocks of 16 output columns ([N/16, K,
16]), and up to six rows accumulate a block in twelve AVX registers, every group of rows over one block before the
next, so the block is read from memory once; OpenMP threads (torch's own runtime: the library names libgomp.so.1,
which torch has loaded) split the blocks. Where ATen reports AVX-512 (and no make test-isa cap sits below it) it is
built with AVX-512: a row's block is one 512-bit register, so twelve rows share one read of the block instead of six
(2026-12-06, a 2-vCPU AMD EPYC with AVX-512, family 26, the same 40 weights, median of 15 at 1 / 2 / 3 / 4 / 6 / 8 /
10 / 12 / 16 rows: AVX2 2.55 / 2.63 / 2.83 / 2.81 / 2.98 / 4.10 / 4.49 / 4.86 / 6.25 ms, AVX-512 2.54 / 2.53 / 2.64 /
2.66 / 2.80 / 3.01 / 3.08 / 3.53 / 4.40: a pass of up to twelve rows costs ~1.2 one-row passes, not 1.6-1.9).

Every output is one sequential fused multiply-add chain over k, whatever the number of rows, their grouping, the threads
or the register width (tests/core/test_avx2.py compares the AVX-512 build with the AVX2 one bit for bit): a row's
product is bit for bit the same in a pass over one row or over twelve, so a verification pass's linears compute exactly
what plain decoding's would (attention and the other ops may still round apart).

It is compiled with the host's C++ compiler (`$CXX`, else g++ or c++) into the selfspec cache once per source and
compiler (atomically: a build beside another never reads a half-written library), and is unavailable, quietly,
where there is no compiler, the CPU (or ATen's or oneDNN's cap, as `make test-isa` sets) has no AVX2, or the build
fails: target/kernels.py then measures only the kernels it has. `reason()` says why.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from typing import Optional

import torch

BLOCK = 16  # output columns per packed block: two AVX registers
MAX_ROWS = 64  # more rows (a prompt's prefill) go to the GEMM libraries, which are made for them
CAPABILITIES = ("AVX2", "AVX512")  # ATen's CPU capabilities that have the kernel's instructions

SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

/* y[m, 16 nb + j] = sum_k x[m, k] w[16 nb + j, k] for M rows (M <= GROUP), block nb of wp [N16/16, K, 16]: one fused
   multiply-add chain per output, k = 0, 1, ..., K-1. The accumulators are named variables, not arrays: gcc kept
   arrays of five and six rows on the stack and stored all of them at every k. Over more than one row the block is
   prefetched 16 cache lines ahead (one row streams fastest on the hardware prefetcher alone). With AVX-512 a row's
   block is one register (its lanes the same fused multiply-adds as two AVX registers': the same bits), so twelve rows
   share a read of the block; with AVX2 it is two, and six rows do. */
#ifdef __AVX512F__
#define GROUP 12
template <int M>
static void block(const float* x, const float* wp, float* y, int K, int ldy, int nb) {
  const float* w = wp + (int64_t)nb * K * 16;
  __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0, c8 = c0, c9 = c0,
         c10 = c0, c11 = c0;
  for (int k = 0; k < K; ++k) {
    if constexpr (M > 1) _mm_prefetch((const char*)(w + (k + 16) * 16), _MM_HINT_T0);
    __m512 w0 = _mm512_loadu_ps(w + k * 16);
#define ROW(m) if constexpr (M > m) c##m = _mm512_fmadd_ps(_mm512_set1_ps(x[(int64_t)m * K + k]), w0, c##m);
    ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5) ROW(6) ROW(7) ROW(8) ROW(9) ROW(10) ROW(11)
#undef ROW
  }
  float* out = y + nb * 16;
#define OUT(m) if constexpr (M > m) _mm512_storeu_ps(out + (int64_t)m * ldy, c##m);
  OUT(0) OUT(1) OUT(2) OUT(3) OUT(4) OUT(5) OUT(6) OUT(7) OUT(8) OUT(9) OUT(10) OUT(11)
#undef OUT
}
#else
#define GROUP 6
template <int M>
static void block(const float* x, const float* wp, float* y, int K, int ldy, int nb) {
  const float* w = wp + (int64_t)nb * K * 16;
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
         c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int k = 0; k < K; ++k) {
    if constexpr (M > 1) _mm_prefetch((const char*)(w + (k + 16) * 16), _MM_HINT_T0);
    __m256 w0 = _mm256_loadu_ps(w + k * 16), w1 = _mm256_loadu_ps(w + k * 16 + 8), b;
#define ROW(m) if constexpr (M > m) { b = _mm256_broadcast_ss(x + (int64_t)m * K + k); \
      c##m##0 = _mm256_fmadd_ps(b, w0, c##m##0); c##m##1 = _mm256_fmadd_ps(b, w1, c##m##1); }
    ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5)
#undef ROW
  }
  float* out = y + nb * 16;
#define OUT(m) if constexpr (M > m) { _mm256_storeu_ps(out + (int64_t)m * ldy, c##m##0); \
    _mm256_storeu_ps(out + (int64_t)m * ldy + 8, c##m##1); }
  OUT(0) OUT(1) OUT(2) OUT(3) OUT(4) OUT(5)
#undef OUT
}
#endif

static void blocks(const float* x, const float* wp, float* y, int M, int K, int ldy, int nb0, int nb1) {
  int groups = (M + GROUP - 1) / GROUP;  /* rows in groups of at most GROUP, as even as possible */
  for (int nb = nb0; nb < nb1; ++nb) {
    int m0 = 0;
    for (int g = 0; g < groups; ++g) {
      int mm = (M - m0 + (groups - g) - 1) / (groups - g);
      const float* xx = x + (int64_t)m0 * K;
      float* yy = y + (int64_t)m0 * ldy;
      switch (mm) {
        case 1: block<1>(xx, wp, yy, K, ldy, nb); break;
        case 2: block<2>(xx, wp, yy, K, ldy, nb); break;
        case 3: block<3>(xx, wp, yy, K, ldy, nb); break;
        case 4: block<4>(xx, wp, yy, K, ldy, nb); break;
        case 5: block<5>(xx, wp, yy, K, ldy, nb); break;
#if GROUP > 6
        case 6: block<6>(xx, wp, yy, K, ldy, nb); break;
        case 7: block<7>(xx, wp, yy, K, ldy, nb); break;
        case 8: block<8>(xx, wp, yy, K, ldy, nb); break;
        case 9: block<9>(xx, wp, yy, K, ldy, nb); break;
        case 10: block<10>(xx, wp, yy, K, ldy, nb); break;
        case 11: block<11>(xx, wp, yy, K, ldy, nb); break;
#endif
        default: block<GROUP>(xx, wp, yy, K, ldy, nb); break;
      }
      m0 += mm;
    }
  }
}

/* x [M, K] and y [M, N16] row-major, wp packed as above; threads split the blocks. */
extern "C" void selfspec_linear(const float* x, const float* wp, float* y, int M, int K, int N16) {
  int nblocks = N16 / 16;
  int threads = omp_get_max_threads();
  if (threads > nblocks) threads = nblocks;
  if (threads <= 1) { blocks(x, wp, y, M, K, N16, 0, nblocks); return; }
#pragma omp parallel num_threads(threads)
  {
    int t = omp_get_thread_num(), n = omp_get_num_threads();
    blocks(x, wp, y, M, K, N16, (int)((int64_t)nblocks * t / n), (int)((int64_t)nblocks * (t + 1) / n));
  }
}
"""
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
# below AVX-512: the names of make test-isa's caps (ONEDNN_MAX_CPU_ISA, any case) under which the kernel is built for
# AVX2 on an AVX-512 CPU (oneDNN's other names, avx512_core and up, leave it AVX-512)
BELOW_AVX512 = ("sse41", "avx2", "avx2_vnni", "avx2_vnni_2")


def _cap() -> str:
    """make test-isa's cap on oneDNN (ONEDNN_MAX_CPU_ISA, lower-cased; "" for none), which the kernel follows too."""
    return os.environ.get("ONEDNN_MAX_CPU_ISA", "").lower()


def width() -> int:
    """The kernel's register width here: 512 where ATen reports AVX-512 and no ONEDNN_MAX_CPU_ISA cap is below it
    (make test-isa's AVX2 run then builds the AVX2 kernel), else 256."""
    return 512 if torch.backends.cpu.get_cpu_capability() == "AVX512" and _cap() not in BELOW_AVX512 else 256


def _flags() -> tuple[str, ...]:
    return FLAGS + (("-mavx512f",) if width() == 512 else ())


@functools.cache
def _library() -> tuple[Optional[ctypes.CDLL], str]:
    """(the built library, "") or (None, why not)."""
    if torch.backends.cpu.get_cpu_capability() not in CAPABILITIES:
        return None, f"this CPU (or ATEN_CPU_CAPABILITY) has no AVX2 ({torch.backends.cpu.get_cpu_capability()})"
    if _cap() == "sse41":  # make test-isa's cap below AVX2
        return None, "ONEDNN_MAX_CPU_ISA caps the CPU below AVX2"
    cxx = next((c for c in (os.environ.get("CXX"), "g++", "c++") if c and shutil.which(c)), None)
    if cxx is None:
        return None, "no C++ compiler ($CXX, g++ or c++) to build it"
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
        from selfspec.target.model import cache_root
        flags = _flags()
        key = hashlib.sha256("\0".join([SOURCE, version, *flags]).encode()).hexdigest()[:16]
        path = cache_root() / "kernels" / f"avx2-linear-{key}.so"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
                src, out = os.path.join(tmp, "linear.cpp"), os.path.join(tmp, "linear.so")
                with open(src, "w") as f:
                    f.write(SOURCE)
                built = subprocess.run([cxx, *flags, src, "-o", out], capture_output=True, text=True, timeout=300)
                if built.returncode != 0:
                    return None, f"{cxx} failed: {(built.stderr.strip().splitlines() or ['?'])[-1]}"
                os.replace(out, path)  # whole or not at all, beside other processes building the same
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"building it failed: {e}"
    lib.selfspec_linear.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 3
    lib.selfspec_linear.restype = None
    return lib, ""


def available() -> bool:
    return _library()[0] is not None


def reason() -> str:
    """Why the kernel is unavailable here ("" where it is available)."""
    return _library()[1]


def pack(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] fp32 -> [ceil(N/16), K, 16], rows past N zero."""
    n, k = w.shape
    n16 = -(-n // BLOCK) * BLOCK
    if n16 != n:
        w = torch.cat([w, w.new_zeros(n16 - n, k)])
    return w.reshape(n16 // BLOCK, BLOCK, k).transpose(1, 2).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, n: int, b: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., K] fp32 (at most MAX_ROWS rows), a weight packed by `pack` with n output rows -> x @ w.T + b, [..., n].
    Checks nothing (target/kernels.py decides what comes here): a decoding pass calls it ~210 times."""
    x = x.contiguous()
    k = x.shape[-1]
    n16 = packed.shape[0] * BLOCK
    y = torch.empty(x.shape[:-1] + (n16,), dtype=torch.float32)
    _library()[0].selfspec_linear(x.data_ptr(), packed.data_ptr(), y.data_ptr(), x.numel() // k, k, n16)
    if n16 != n:
        y = y[..., :n]
    if b is not None:
        y = y + b
    return y
