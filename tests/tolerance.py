"""How far two computations of the same floats may differ when they round differently: another GEMM kernel (MKL's
sgemm or oneDNN's packed inner product, each dispatching on the CPU's instruction set: SSE4.1, AVX2, AVX-512, AMX),
another shape (one position or a batch, a cached pass or a whole one), another summation order. Tests comparing such
computations take their tolerance from here, derived from the dtype and the reduction length, never a number that
held on one host (issue 63: an `atol=1e-5` that held on AVX2 and AVX-512 EPYCs failed on an AMX Xeon).

The bound. A sum of N rounded operations with unit roundoff u (2^-24 fp32, 2^-8 bf16, 2^-11 fp16, 2^-53 fp64), in any
order and blocking, is within N u S / (1 - N u) of the exact value, S = sum_i |x_i y_i| for a dot product (Higham,
Accuracy and Stability of Numerical Algorithms, 3.1); that worst case needs every rounding to go the same way. With
the rounding errors independent and of mean zero it is within lambda sqrt(N) u S except with probability at most
about 2 N exp(-lambda^2 / 2) (Higham and Mary, SIAM J. Sci. Comput. 41(5), 2019, from the Azuma-Hoeffding
inequality): lambda = 8 makes that 2.5e-14 N per element. Two computations, each that close to the exact value,
differ by at most twice it.

A network's output chains `ops` reductions of length at most K (per pre-norm decoder layer LAYER_OPS: the norm's
mean square, q/k/v, q.k, softmax's sum, p.v, o_proj, the second norm, gate/up, down); each adds its roundings to the
errors the earlier ones passed on, and a residual layer passes its input's error on to its output, so the output
carries at most N = K * ops roundings:

    |a - b| <= 2 lambda sqrt(K * ops) u S

S is the magnitude of the summed terms: the test's own max (|x| @ |w|.T) where it has a product's operands, else the
compared values' largest magnitude (a residual stream is its partial sums: each layer adds to it). That is a model of
independent roundings and of a residual stream, not a proof (the worst case is sqrt(N) times wider); measured on a
2-core AMD EPYC (avx512_bf16) with oneDNN and MKL capped at SSE4.1, AVX2, AVX-512 and AVX-512 BF16, the largest
difference in any test using it was 1/60 of its bound (a twentieth of each bound still passed on every path, a
hundredth failed 10-11 tests), and the AMX Xeon's 1.77e-5 in the P-EAGLE test of issue 63 is 1/70 of that test's bound.

It still fails a real bug: in fp32 the bound is 4e-6 to 8e-5 of S in these tests, and a one-sided error of 0.1% (an
attention scale in the cached path only, the decoding pass's inputs scaled) failed every test it reached, as did a
leaked position (DFlash's block mask off by one). Comparisons that must be bit-identical (greedy tokens, exported
bytes, the same kernels on the same inputs) do not come here.
"""

from __future__ import annotations

import math
from typing import Optional

import pytest
import torch

LAMBDA = 8.0  # the probabilistic bound's multiple: exceeded with probability <= 2 N exp(-32) per element
LAYER_OPS = 9  # reductions one pre-norm decoder layer chains (norm, qkv, q.k, softmax, p.v, o, norm, gate/up, down)


def unit_roundoff(dtype: torch.dtype) -> float:
    """u: half the gap between 1 and the next float (2^-24 fp32, 2^-8 bf16, 2^-11 fp16, 2^-53 fp64)."""
    return torch.finfo(dtype).eps / 2


def relative_bound(dtype: torch.dtype, k: int, ops: int = 1) -> float:
    """How far two roundings of `ops` chained reductions of length <= `k` may drift apart, per unit of S."""
    return 2 * LAMBDA * math.sqrt(k * ops) * unit_roundoff(dtype)


def tolerance(dtype: torch.dtype, k: int, ops: int = 1, scale: float = 1.0) -> dict:
    """rtol and atol (torch.testing.assert_close's keywords) for two computations in `dtype` of `ops` chained
    reductions of length <= `k` whose summed terms have magnitude `scale` (S)."""
    bound = relative_bound(dtype, k, ops)
    return {"rtol": bound, "atol": bound * float(scale)}


def terms(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor] = None) -> float:
    """S of x @ w.T + b (a linear's output): the largest sum of its terms' magnitudes."""
    s = x.detach().abs() @ w.detach().abs().T
    return float((s if b is None else s + b.detach().abs()).max())


def layers(config, n: int, width: int = 0, positions: int = 0, ops: int = 0) -> dict:
    """k and ops of `n` decoder layers of `config` (a transformers config), fed by a reduction of length `width`
    (an fc over concatenated states), attending over `positions`, with `ops` more reductions around them."""
    k = max(config.hidden_size, config.intermediate_size, width, positions)
    return {"k": k, "ops": LAYER_OPS * n + ops}


def assert_close(got: torch.Tensor, want: torch.Tensor, *, k: int, ops: int = 1, scale: Optional[float] = None,
                 msg=None) -> None:
    """torch.testing.assert_close with the derived tolerance; `scale` (S) defaults to max |want|."""
    torch.testing.assert_close(got, want, msg=msg, **_of(want, k, ops, scale))


def close(got: torch.Tensor, want: torch.Tensor, *, k: int, ops: int = 1, scale: Optional[float] = None) -> bool:
    """torch.allclose with the derived tolerance (inside a longer assertion); `scale` (S) defaults to max |want|."""
    tol = _of(want, k, ops, scale)
    return torch.allclose(got, want, rtol=tol["rtol"], atol=tol["atol"])


def approx(want: float, *, k: int, ops: int = 1, scale: Optional[float] = None, dtype=torch.float32):
    """pytest.approx of a scalar computed in `dtype`, with the derived tolerance; `scale` (S) defaults to |want|."""
    tol = tolerance(dtype, k, ops, abs(want) if scale is None else scale)
    return pytest.approx(want, rel=tol["rtol"], abs=tol["atol"])


def _of(want, k, ops, scale):
    return tolerance(want.dtype, k, ops, float(want.detach().abs().max()) if scale is None else scale)
