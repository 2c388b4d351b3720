"""scripts/profile_step.py on a tiny target: it runs methods/eagle/train.py's step phase by phase, the phases cover the
step's time, and every achieved/peak ratio is a finite positive number."""

import json
import math

import pytest

from selfspec.scripts.profile_step import main

TINY = ["target=tiny-llama", "data=tiny", "draft.vocab_size=40", "steps=2", "warmup=1", "peak_repeats=1",
        "threads=1"]


@pytest.mark.parametrize("overrides, passes", [
    ([], ["epoch 1 (memo miss)", "later epochs (memo hit)"]),  # the shipped recipe: bf16, TTT 3, feature memo
    (["~experiment", "train.feature_memo_gb=0"], ["every epoch (no memo)"]),  # fp32, teacher-forced, no memo
], ids=["recipe", "plain"])
def test_phases_cover_the_step_and_ratios_are_finite(tmp_path, overrides, passes):
    out = tmp_path / "profile.json"
    report = main(TINY + overrides + [f"output_file={out}"])
    assert json.loads(out.read_text())["passes"].keys() == report["passes"].keys()
    assert [name for name in report["passes"] if "target alone" not in name] == passes
    for name in passes:
        phases, step = report["passes"][name]["phases"], report["passes"][name]["step"]
        assert {"data", "soft labels", "head forward", "loss", "backward", "optimizer"} <= phases.keys()
        assert ("target forward" in phases) == ("hit" not in name)  # a memo hit skips the target
        covered = sum(r["share"] for k, r in phases.items() if k != "other")
        assert 0.8 <= covered <= 1.1, (name, covered)  # medians of shares; the glue between phases is small
        rows = [r for r in phases.values() if "ratio" in r] + [step]
        assert len(rows) >= 5
        for r in rows:
            assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("achieved_gflops", "peak_gflops", "ratio"))


def test_the_recipes_levers_reach_the_profiled_loss(tmp_path):
    """profile_step times train/eagle.micro_step itself: eagle.topk and ttt.on_policy change the loss it records,
    and the same config records the same loss (no copy of the loss left to drift)."""
    def loss(*overrides):
        out = tmp_path / f"p{len(list(tmp_path.iterdir()))}.json"
        report = main(TINY[:3] + ["steps=1", "warmup=0", "peak_repeats=1", "threads=1", "~experiment",
                                  "train.feature_memo_gb=0", "ttt.steps=2", *overrides, f"output_file={out}"])
        return report["passes"]["every epoch (no memo)"]["per_step"][0]["loss"]

    base = loss()
    assert loss() == base
    assert loss("eagle.topk=5") != base
    assert loss("ttt.on_policy=true") != base


def test_matmuls_counted_from_a_torch_that_records_no_dtypes():
    """torch 2.11 (an H200 image's build, 2026-11-30) profiles events with no `input_dtypes`: profile_step failed with
    AttributeError there. Its matmuls are still counted from their shapes (as float32, the dtype left unrecorded)."""
    from types import SimpleNamespace

    from selfspec.train.step_profile import gemms

    old = SimpleNamespace(name="aten::addmm", input_shapes=[[64], [8, 32], [32, 64]], concrete_inputs=[])
    new = SimpleNamespace(**vars(old), input_dtypes=["c10::BFloat16"] * 3)
    assert gemms(old) == [((8, 32, 64, 1, "float32"), 1)]
    assert gemms(new) == [((8, 32, 64, 1, "bfloat16"), 1)]
    sdpa = SimpleNamespace(name="aten::_scaled_dot_product_flash_attention", input_shapes=[[1, 2, 8, 4]] * 3,
                           concrete_inputs=[])
    assert gemms(sdpa) == [((8, 4, 8, 2, "float32"), 1), ((8, 8, 4, 2, "float32"), 1)]  # Q K^T, P V
