"""scripts/sweep_exit.py on a tiny target: untrained exits, and exits it trains itself (train_minutes > 0)."""

import json

import pytest
import torch

from selfspec.scripts.sweep_exit import main

TINY = ["target=tiny-llama", "data=tiny", "exit_layers=[1]", "eval_prompts=2", "eval_new_tokens=8", "ks=[1,2]",
        "chain_k=2", "context_tokens=16", "repeats=1"]


@pytest.mark.parametrize("minutes", [0, 0.02])
def test_sweep_table_with_untrained_and_trained_exits(tmp_path, minutes):
    out = tmp_path / "sweep.json"
    report = main([*TINY, f"train_minutes={minutes}", f"output_file={out}",
                   'train_overrides=["data=tiny","train.batch_size=2","train.mixed_precision=bf16"]'])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert torch.is_grad_enabled()  # in-process callers (the tests after this one) keep gradients
    (row,) = report["rows"]
    assert row["exit_layer"] == 1 and 0 <= row["top1"] <= 1 and row["best_k"] in (1, 2)
    assert set(row["predicted_speedup"]) == {1, 2} and row["c_full_ms"] > 0
    assert out.with_suffix(".png").exists()
    # a trained exit is written where the sweep says, as a head folder decode/ loads
    assert (tmp_path / "E1" / "head" / "config.json").exists() == (minutes > 0)
