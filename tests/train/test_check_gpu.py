"""scripts/check_gpu.py (`make check-gpu`): what can be checked without a GPU — its refusals and its table."""

import pytest
import torch

from selfspec.scripts import check_gpu


def test_refuses_without_a_gpu_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "check"
    with pytest.raises(SystemExit) as e:
        check_gpu.main([f"out_dir={out}"])
    assert e.value.code == 2
    assert not out.exists()


@pytest.mark.parametrize("override, message", [("phases=[env,train]", "unknown phases ['train']"),
                                                ("out_dir={tmp}", "exists")])
def test_bad_options_are_one_line_errors(tmp_path, capsys, override, message):
    with pytest.raises(SystemExit) as e:
        check_gpu.main([override.format(tmp=tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_table_reports_each_phase_and_the_bench():
    report = {"ddp": {"rc": 0, "wall_s": 89, "distributed_type": "MULTI_GPU", "tokens_per_s": 6664.0,
                      "peak_gpu_mib": 3297.3, "heldout": {"tau": 1.348}},
              "fsdp": {"rc": 1, "wall_s": 36},
              "bench": {"rc": 0, "target": {"tau": 1.0, "tokens_per_s": 50.6, "speedup": 1.035, "identical": True}}}
    lines = check_gpu.table(report).splitlines()
    assert "| ddp | 0 | 89 | MULTI_GPU | 6664.0 | 3297.3 | 1.348 |" in lines
    assert "| fsdp | 1 | 36 | - | - | - | - |" in lines
    assert "| target | 1.0 | 50.6 | 1.035 | True |" in lines
    assert not any(line.startswith("| flagship") for line in lines)  # a phase that did not run has no row
