"""train.mixed_precision / train.features_dtype `auto`: bf16 only where the device computes it natively (an
AVX2-only CPU emulates bf16, 6x slower than fp32), resolved in place before the run starts."""

from pathlib import Path

import pytest

import selfspec.target.model as target_mod
from selfspec.core.errors import UserError
from selfspec.train.config import TrainConfig, check_precision


@pytest.mark.parametrize("native, want", [(True, ("bf16", "bfloat16")), (False, ("no", "float32"))])
def test_auto_follows_the_hardware(monkeypatch, native, want):
    monkeypatch.setattr(target_mod, "native_bf16", lambda: native)
    tc = TrainConfig(mixed_precision="auto", features_dtype="auto")
    check_precision(tc)
    assert (tc.mixed_precision, tc.features_dtype) == want


def test_explicit_values_are_kept(monkeypatch):
    monkeypatch.setattr(target_mod, "native_bf16", lambda: False)
    tc = TrainConfig(mixed_precision="bf16", features_dtype="bfloat16")
    check_precision(tc)
    assert (tc.mixed_precision, tc.features_dtype) == ("bf16", "bfloat16")
    with pytest.raises(UserError, match="use one of no, bf16, fp16, auto"):
        check_precision(TrainConfig(mixed_precision="fp8"))


@pytest.mark.parametrize("flags, native", [("flags : avx avx2 fma", False), ("flags : avx2 avx512f avx512_bf16", True),
                                           ("flags : avx2 amx_bf16 amx_tile", True)])
def test_native_bf16_reads_the_cpu_flags(monkeypatch, flags, native):
    monkeypatch.setattr(target_mod.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: flags)
    assert target_mod.native_bf16() is native
