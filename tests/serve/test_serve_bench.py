"""scripts/serve_bench.py's checks before it starts any engine (the engines themselves: `make check-llamacpp`,
`make check-vllm`, not part of the tests; their wrappers in serve/: tests/serve/test_serve.py)."""

import pytest
from omegaconf import OmegaConf

from selfspec.core.errors import UserError
from selfspec.scripts.serve_bench import check_config
from selfspec.serve.bench import ServeBenchConfig


def _cfg(**kw):
    return OmegaConf.merge(OmegaConf.structured(ServeBenchConfig), {"head": "h", "engines": ["selfspec"], **kw})


@pytest.mark.parametrize("kw, message", [
    ({"engines": ["vllm"], "vllm_python": "/nonexistent/python"}, "no vLLM venv at '/nonexistent/python'"),
    ({"vllm_dtypes": ["float16"]}, "vllm_dtypes ['float16']"),
    ({"engines": ["sglang"]}, "each must be one of selfspec, llamacpp, vllm"),
    ({"head": "<set head=FOLDER>"}, "pass head="),
])
def test_refuses_before_any_engine_starts(kw, message):
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("]", r"\]")):
        check_config(_cfg(**kw))


def test_accepts_the_vllm_engine_with_a_venv(tmp_path):
    python = tmp_path / "python"
    python.write_text("")
    check_config(_cfg(engines=["selfspec", "vllm"], vllm_python=str(python)))


def test_the_report_names_the_cpu_it_ran_on():
    """Speeds move between hosts (the same VM image ran on an AMD EPYC and an Intel Xeon): the JSON says which."""
    import os
    from pathlib import Path

    from selfspec.serve.report import machine

    name = machine()
    assert name.endswith(f", {os.cpu_count()} CPUs")
    if Path("/proc/cpuinfo").exists():
        assert not name.startswith("unknown CPU") and name.split(",")[0] in Path("/proc/cpuinfo").read_text()


def test_divergence_reads_the_fp32_logits_at_the_first_difference():
    import torch

    from selfspec.core.target import load_target
    from selfspec.serve.report import divergence

    target = load_target("tiny:llama")
    prompt = [1, 5, 9]
    with torch.no_grad():
        logits = target.model(torch.tensor([prompt + [7, 8]])).logits[0, -1]
    top2 = logits.topk(2).indices.tolist()
    d = divergence(target, prompt, [7, 8, top2[0], 3], [7, 8, top2[1]])
    assert d["position"] == 2 and (d["fp32_rank_plain"], d["fp32_rank_token"]) == (0, 1)
    assert d["fp32_gap"] == pytest.approx(float(logits[top2[0]] - logits[top2[1]]), abs=1e-4) and d["fp32_gap"] >= 0
    assert "prefix" in divergence(target, prompt, [7, 8], [7, 8, 9])["note"]


def test_a_target_without_a_local_folder_is_refused_before_any_engine_runs(tmp_path, capsys):
    """vLLM serves (and llama.cpp converts) the target's HF folder: a target with none (tiny:llama) is refused
    before selfspec's rows are measured and before work_dir is made."""
    import torch

    from selfspec.core.target import load_target
    from selfspec.heads.checkpoint import head_record, save_head
    from selfspec.heads.eagle3 import build_eagle3
    from selfspec.scripts.serve_bench import main

    target = load_target("tiny:llama")
    torch.manual_seed(0)
    head = build_eagle3(target.model, aux_layers=[0, 1, 1], vocab_size=32, draft_vocab=torch.arange(40, 72))
    save_head(head, tmp_path / "h", head_record(head, target.identity, training={}, metrics={}))
    python = tmp_path / "python"
    python.write_text("")
    with pytest.raises(SystemExit) as e:
        main([f"head={tmp_path / 'h'}", "target=tiny-llama", "data=tiny", "engines=[selfspec,vllm]",
              f"vllm_python={python}", f"work_dir={tmp_path / 'work'}", f"output_file={tmp_path / 'o.json'}"])
    assert e.value.code == 2 and "has no local HF folder" in capsys.readouterr().err
    assert not (tmp_path / "work").exists()
