"""A long run prints what the host computes (torch.matmul in fp32 and bf16 at the head's largest layer) when it
starts, and, once warm, its rate and the hours the shipped flagship's training would take at it (train/host.py)."""

import json
import re

import pytest
import torch

from selfspec.train.host import LONG_STEPS, RATE_STEPS, flagship_training, host_line, largest_layer, rate_line


def test_the_host_line_measures_both_dtypes_at_the_heads_largest_layer():
    head = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 300), torch.nn.Linear(300, 8))
    assert largest_layer(head) == (32, 300) and largest_layer(torch.nn.ReLU()) == (1024, 1024)
    line = host_line(largest_layer(head), "cpu", "no")
    fp32, bf16 = (float(x) for x in re.search(r"matmul (\d+) GFLOP/s in fp32, (\d+) in bf16", line).groups())
    assert fp32 > 0 and bf16 > 0, line
    assert "[512 x 32] x [32 x 300]" in line and line.endswith("computes in fp32")
    assert host_line((4, 4), "cpu", "bf16").endswith("computes in bf16 (autocast)")


def test_the_rate_line_is_the_flagships_recorded_tokens_over_the_runs_rate(tmp_path):
    assert flagship_training(tmp_path) is None and rate_line(100.0, RATE_STEPS, tmp_path) is None  # none ships
    for name, seconds in (("smollm2-135m-eagle3", 3600.0), ("smollm2-135m-dflash", 99999.0)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"training": {"train_seconds": seconds,
                                                                                "tokens_per_s": 1000.0}}))
    assert flagship_training(tmp_path) == ("smollm2-135m-eagle3", 3.6e6)  # registry.FLAGSHIP's, not the largest
    line = rate_line(500.0, RATE_STEPS, tmp_path)
    assert line.endswith("(3.60M tokens) would take 2.0 h at this rate") and "500 training tokens a second" in line
    name, tokens = flagship_training()  # the shipped one
    assert name.endswith("eagle3") and tokens > 1e6


@pytest.mark.parametrize("steps", [LONG_STEPS, LONG_STEPS - 1])
def test_a_long_run_prints_both_lines_and_a_short_one_neither(steps, tmp_path, capsys):
    from selfspec.methods.eagle.train import main

    main(argv=["target=tiny-llama", "data=tiny", f"train.max_steps={steps}", "train.eval_prompts=0",
               "train.save_every=0", "train.log_every=50", f"output_dir={tmp_path / 'run'}"])
    out = capsys.readouterr()
    text = out.out + out.err
    assert ("[train] host: " in text) == (steps >= LONG_STEPS)
    assert (f"training tokens a second over the first {RATE_STEPS} steps" in text) == (steps >= LONG_STEPS)
