"""scripts/replay_lookup.py on reports made here from a tiny target's own decoding: the replayed tokens a pass equal the
engine's, the cost model is fitted back from speedups it generated, an old suite report's prompts are rebuilt, and
bad input is one line."""

import json

import pytest

from selfspec.data.suites import Question
from selfspec.decode.drafters.ngram import NgramDrafter
from selfspec.decode.drafters.suffix import SuffixDrafter
from selfspec.decode.engine import generate
from selfspec.scripts.replay_lookup import main
from selfspec.target.model import load_target
from entry_points import refused, run

NEW = 24
COSTS = (0.2, 0.15)  # the speedups below are made with these: the script must fit them back
QUESTIONS = {"mt_bench": [Question("mt_bench", "writing", "mt_bench/81", ("one two three one two three one two",
                                                                         "Again: one two three."))],
             "humaneval": [Question("humaneval", "humaneval", "HumanEval/0", ("def f(a): return a; def g(a):",))]}


@pytest.fixture
def suite(monkeypatch):
    from selfspec.data import suites

    monkeypatch.setattr(suites, "load_suite", lambda name, root, per_category=0: QUESTIONS[name])


def _report(path, keep_prompts=True):
    """A serve_bench suite report of tiny:llama: plain, ngram and suffix rows decoded by the engine."""
    from omegaconf import OmegaConf

    from selfspec.engines.suites import suite_prompts

    target = load_target("tiny:llama")
    cfg = OmegaConf.create({"suite": "all", "suite_questions": {"mt_bench": 1, "humaneval": 1},
                            "max_new_tokens": NEW, "target": {"cache_dir": None}})
    prompts, labels = suite_prompts(cfg, target)
    rows, tokens = {}, {}
    plain = [generate(target, None, ids, NEW).tokens for ids in prompts]
    generated = sum(map(len, plain))
    for name, make in (("ngram", lambda: NgramDrafter(num_draft=5)), ("suffix", lambda: SuffixDrafter(num_draft=16))):
        results = [generate(target, make(), ids, NEW) for ids in prompts]
        assert [r.tokens for r in results] == plain
        passes, committed = sum(r.verify_passes for r in results), sum(r.committed_by_verify for r in results)
        drafted_passes = sum(r.proposed_by_position[0] if r.proposed_by_position else 0 for r in results)
        drafted = sum(r.drafted_tokens for r in results)
        steps = len(prompts) + passes + COSTS[0] * drafted_passes + COSTS[1] * drafted
        rows[name] = {"all": {"tokens_per_pass": round(generated / (generated - (committed - passes)), 3),
                              "speedup": generated / steps}}
        tokens[name] = plain
    rows["plain"] = {"all": {"tokens_per_pass": 1.0, "speedup": 1.0}}
    report = {"target": "tiny:llama", "suite": "all", "suite_questions": {"mt_bench": 1, "humaneval": 1},
              "labels": labels, "max_new_tokens": NEW, "categories": {"selfspec fp32": rows},
              "tokens": {"selfspec fp32": {"plain": plain, **tokens}}}
    if keep_prompts:
        report["prompt_tokens"] = prompts
    path.write_text(json.dumps(report))
    return report


def _result(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("keep_prompts", [True, False])
def test_replayed_tokens_a_pass_equal_the_engines_and_the_costs_are_fitted_back(keep_prompts, suite, tmp_path, capsys):
    report = _report(tmp_path / "r.json", keep_prompts)
    assert run(main, f"report={tmp_path / 'r.json'}", "+variants.deep={alpha: 3.0}") == 0
    out = _result(capsys)
    for name in ("ngram", "suffix"):
        v = out["variants"][name]
        measured = report["categories"]["selfspec fp32"][name]["all"]
        assert v["measured"] == measured["tokens_per_pass"]
        assert v["tokens_per_pass"] == pytest.approx(measured["tokens_per_pass"], abs=6e-4)
        assert v["modelled_speedup"] == pytest.approx(measured["speedup"], abs=2e-3)
    assert out["exact"] == ["ngram", "suffix"]
    assert out["variants"]["suffix"]["tokens_per_pass"] > 1.0  # drafts were accepted: the counts are not trivial
    assert (out["costs"]["round"], out["costs"]["row"]) == pytest.approx(COSTS, abs=2e-3)
    assert out["variants"]["deep"]["lookup"]["alpha"] == 3.0 and out["variants"]["deep"]["measured"] is None
    assert set(out["variants"]["suffix"]["by_category"]) == {"writing", "humaneval"}


def test_bad_input_is_one_line(suite, tmp_path, capsys):
    assert run(main, f"report={tmp_path / 'missing.json'}") == 2
    refused(capsys, "cannot read report")
    (tmp_path / "summary.json").write_text(json.dumps({"engines": {}}))
    assert run(main, f"report={tmp_path / 'summary.json'}") == 2
    refused(capsys, "not a serve_bench report with token ids and figures per category")
    _report(tmp_path / "r.json")
    assert run(main, f"report={tmp_path / 'r.json'}", "engine=vLLM float32") == 2
    refused(capsys, "no plain row", "selfspec fp32")
    assert run(main, f"report={tmp_path / 'r.json'}", "+variants.bad={min_porb: 0.5}") == 2
    refused(capsys, "variants.bad", "min_porb")
    assert run(main, f"report={tmp_path / 'r.json'}", f"+variants.c={{corpus: {tmp_path / 'none.txt'}}}") == 2
    refused(capsys, "none.txt")
    report = json.loads((tmp_path / "r.json").read_text())
    report["max_new_tokens"] = 3  # outputs longer than the run could have made: a report edited or mixed up
    (tmp_path / "r.json").write_text(json.dumps(report))
    assert run(main, f"report={tmp_path / 'r.json'}") == 2
    refused(capsys, "max_new_tokens=3", "prompt 0")
