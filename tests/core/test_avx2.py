"""target/avx2.py: our AVX2 linear computes F.linear's result for any shape, the same bits for a row whatever rows,
threads or grouping it is computed among, serves only what it can, is built once into the cache, and leaves a
target whose greedy decoding with a head stays lossless (core/test_kernels.py: the heads follow the target)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from selfspec.core.errors import UserError
from selfspec.target import avx2, kernels
from selfspec.target.kernels import PackedLinear, linear
from selfspec.target.model import load_target
from tolerance import assert_close, layers, terms

needs_avx2 = pytest.mark.skipif(not avx2.available(), reason=f"no avx2 kernel here: {avx2.reason()}")
# A CPU (or an ATEN_CPU_CAPABILITY) without AVX2 says so before any cap is asked: the cap's own reason needs AVX2
cpu_has_avx2 = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in avx2.CAPABILITIES,
                                  reason=f"this CPU has no AVX2 ({torch.backends.cpu.get_cpu_capability()})")


@needs_avx2
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 12, 13, 64])
@pytest.mark.parametrize("n,k", [(96, 48), (40, 33), (7, 5), (576, 576)])  # N not a multiple of 16; odd K
def test_avx2_linear_is_f_linear(rows, n, k):
    torch.manual_seed(rows)
    w, b, x = torch.randn(n, k), torch.randn(n), torch.randn(rows, k)
    with torch.no_grad():
        got = linear(x, w, b, kind="avx2")
        assert (id(w), "avx2") in kernels._PACKED  # its path ran, not the fallback
        assert got.shape == (rows, n) and got.is_contiguous()
        assert_close(got, F.linear(x, w, b), k=k + 1, scale=terms(x, w, b))
        assert_close(linear(x.reshape(1, rows, k), w, kind="avx2"), F.linear(x, w).reshape(1, rows, n), k=k,
                     scale=terms(x, w))


@needs_avx2
def test_a_row_is_the_same_bits_among_any_rows_and_threads():
    """One fused multiply-add chain per output: a verification pass's linears give a row exactly what a one-row step
    gives it (neither MKL's sgemm nor oneDNN's packed kernel promise that: their sums split by shape)."""
    torch.manual_seed(0)
    w, x = torch.randn(1536, 576), torch.randn(20, 576)
    threads = torch.get_num_threads()
    with torch.no_grad():
        alone = torch.cat([linear(x[i:i + 1], w, kind="avx2") for i in range(20)])
        for m in (2, 3, 7, 12, 20):
            assert torch.equal(linear(x[:m], w, kind="avx2"), alone[:m])
        try:
            torch.set_num_threads(1)
            assert torch.equal(linear(x[:9], w, kind="avx2"), alone[:9])
        finally:
            torch.set_num_threads(threads)


@pytest.mark.skipif(not (avx2.available() and avx2.width() == 512), reason="no AVX-512 kernel here")
def test_the_avx512_kernel_gives_the_avx2_kernels_bits(tmp_path):
    """On an AVX-512 CPU the kernel runs a row's block in one 512-bit register (twelve rows per read of it); under make
    test-isa's AVX2 cap it is built for AVX2 (two registers, six rows): every output is the same fused multiply-add
    chain either way, so both give the same bits, for any rows. A fresh interpreter builds the capped one."""
    torch.manual_seed(0)
    w, x = torch.randn(100, 576), torch.randn(30, 576)
    torch.save((w, x), tmp_path / "in.pt")
    code = ("import sys, torch\nfrom selfspec.target import avx2\nfrom selfspec.target.kernels import linear\n"
            "w, x = torch.load(sys.argv[1])\nassert avx2.available(), avx2.reason()\n"
            "with torch.no_grad():\n"
            "    torch.save([avx2.width()] + [linear(x[:m], w, kind='avx2') for m in range(1, 31)], sys.argv[2])\n")
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "SELFSPEC_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    width, *capped = torch.load(tmp_path / "out.pt")
    assert width == 256
    with torch.no_grad():
        for m in range(1, 31):
            assert torch.equal(linear(x[:m], w, kind="avx2"), capped[m - 1]), m


@needs_avx2
def test_serves_only_what_it_can():
    torch.manual_seed(0)
    w = torch.randn(32, 16)
    x = torch.randn(4, 16, requires_grad=True)
    linear(x, w, kind="avx2").sum().backward()  # autograd: F.linear, which has a backward
    assert (id(w), "avx2") not in kernels._PACKED and x.grad is not None
    with torch.no_grad():
        many = torch.randn(avx2.MAX_ROWS + 1, 16)
        assert torch.equal(linear(many, w, kind="avx2"), F.linear(many, w))  # a prefill: the library's GEMM itself
        assert (id(w), "avx2") not in kernels._PACKED
        assert linear(x.bfloat16(), w.bfloat16(), kind="avx2").dtype == torch.bfloat16
        w.mul_(2.0)
        linear(x, w, kind="avx2")
        w.mul_(0.5)  # a stale packed copy would still give twice the product
        assert_close(linear(x, w, kind="avx2"), F.linear(x, w), k=16, scale=terms(x, w))


@cpu_has_avx2
def test_unavailable_under_a_cap_below_avx2_and_says_why(tmp_path):
    """make test-isa's SSE41 run caps oneDNN below AVX2: our AVX2 kernel stands aside with it (auto measures the
    others), and naming it is a one-line error. A fresh interpreter: the library is found once per process."""
    code = ("from selfspec.target import avx2, kernels\n"
            "print(avx2.available(), avx2.reason(), 'avx2' in kernels.measured(), sep='|')\n")
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "SSE41", "SELFSPEC_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False|ONEDNN_MAX_CPU_ISA caps the CPU below AVX2|False"
    assert "(avx2: ONEDNN_MAX_CPU_ISA caps the CPU below AVX2)" in out.stderr
    assert not (tmp_path / "kernels").exists()  # nothing built


@needs_avx2
def test_built_once_into_the_cache_under_its_source_and_compiler(tmp_path):
    code = "from selfspec.target import avx2\nprint(avx2.available())\n"
    env = {**os.environ, "SELFSPEC_CACHE": str(tmp_path)}
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr
        built = sorted(p.name for p in (tmp_path / "kernels").iterdir())
        assert len(built) == 1 and built[0].startswith("avx2-linear-") and built[0].endswith(".so")  # no temporaries
    env["CXX"] = "/nonexistent/compiler"  # not found: the next of g++, c++ builds it, under the same name
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "True"


def test_named_where_it_cannot_apply_is_one_line():
    with pytest.raises(UserError, match="unknown target.kernels 'avx2:2'"):
        load_target("/nonexistent/folder", kernels="avx2:2")
    with pytest.raises(UserError, match="kernels=avx2 needs an fp32 target on a CPU with AVX2"):
        load_target("tiny:llama", dtype="bfloat16", kernels="avx2")


@needs_avx2
def test_a_target_on_avx2_looks_the_same_and_computes_the_same():
    fast = load_target("tiny:llama", seed=4, kernels="avx2")
    plain = load_target("tiny:llama", seed=4, kernels="default")
    assert fast.kernels == "avx2"
    linears = [m for m in fast.model.modules() if type(m) is PackedLinear]
    assert len(linears) == 2 * 7 + 1 and {(m.kind, m.packed_from) for m in linears} == {("avx2", 1)}
    assert fast.model.state_dict().keys() == plain.model.state_dict().keys() and fast.identity == plain.identity
    ids = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        assert_close(fast.model(ids).logits, plain.model(ids).logits,
                     **layers(fast.model.config, 2, positions=12, ops=2))
    assert (id(fast.model.model.layers[0].mlp.up_proj.weight), "avx2") in kernels._PACKED


@needs_avx2
def test_a_packed_linear_skips_the_checks_only_while_nothing_they_check_has_changed():
    """PackedLinear on avx2 serves its packed weight without `linear`'s per-call checks once `linear` has packed it
    (~20 us of Python a call, ~4 ms of a SmolLM2 pass); it gives `linear`'s bits, and everything `linear` would not
    serve, or would repack for, still goes through `linear`: the weight changed in place, given new storage or
    replaced, autograd, autocast, another dtype, more than MAX_ROWS rows, no rows."""
    torch.manual_seed(0)
    m = torch.nn.Linear(40, 24)
    m.__class__, m.kind = PackedLinear, "avx2"
    x = torch.randn(1, 3, 40)

    def agrees(y, x=x):
        assert_close(y, F.linear(x, m.weight, m.bias), k=41, scale=terms(x, m.weight, m.bias))

    with torch.no_grad():
        first = m(x)
        assert m._served is not None and m._served[0]() is m.weight  # packed: later calls skip the checks
        assert torch.equal(m(x), first) and torch.equal(first, linear(x, m.weight, m.bias, kind="avx2"))
        agrees(first)
        m.weight.mul_(2.0)  # in place: a stale packed copy would give the old product
        agrees(m(x))
        m.weight.data = torch.randn(24, 40)  # new storage, same version
        agrees(m(x))
        m.weight = torch.nn.Parameter(torch.randn(24, 40))  # replaced
        agrees(m(x))
        assert m._served[0]() is m.weight
        many = torch.randn(avx2.MAX_ROWS + 1, 40)
        assert torch.equal(m(many), F.linear(many, m.weight, m.bias))  # a prefill: the library's GEMM
        assert m(torch.randn(0, 40)).shape == (0, 24)
        for wrong in (m, lambda x: linear(x, m.weight, kind="avx2")):  # a wrong width: F.linear's error, not a read
            with pytest.raises(RuntimeError, match="cannot be multiplied"):  # past the packed weight's end
                wrong(torch.randn(2, 41))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert m(x).dtype == torch.bfloat16
    xg = x.clone().requires_grad_()
    m(xg).sum().backward()  # autograd: F.linear, which has a backward
    assert xg.grad is not None and m.weight.grad is not None
    m.to(torch.bfloat16)  # the same Parameter, another dtype
    with torch.no_grad():
        assert torch.equal(m(x.bfloat16()), F.linear(x.bfloat16(), m.weight, m.bias))
