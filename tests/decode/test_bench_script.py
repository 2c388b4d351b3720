"""scripts/bench.py runs every method interleaved and writes its JSON table and plots (tiny target)."""

from __future__ import annotations

import json

import pytest
import torch

from selfspec.heads.checkpoint import head_record, save_head
from selfspec.methods.eagle.head import build_eagle
from selfspec.scripts import bench, eval_heads


def test_bench_writes_json_and_plots(tmp_path, tiny_target):
    target = tiny_target("llama")
    torch.manual_seed(0)
    head = build_eagle(target.model)
    save_head(head, tmp_path / "head", head_record(head, target.identity))
    out = tmp_path / "bench"
    bench.main(argv=["target=tiny-llama", f"head={tmp_path / 'head'}", "max_prompts=2", "max_new_tokens=12",
                     "methods=[target,target_fp32_head,hf_greedy,hf_prompt_lookup,ngram,eagle,eagle_tree]",
                     "sweep_k=[1,2]",
                     f"output_file={out / 'bench.json'}"])
    report = json.loads((out / "bench.json").read_text())
    methods = report["methods"]
    assert set(methods) == {"target", "target_fp32_head", "hf_greedy", "hf_prompt_lookup", "ngram", "eagle",
                            "eagle_tree"}
    for name, m in methods.items():
        assert {"tau", "tokens_per_s", "speedup", "identical"} <= set(m)
        assert m["identical"] is True, name  # greedy: every method reproduces the target
    assert methods["target"]["tau"] == 1.0
    assert (out / "acceptance_by_position.png").exists() and (out / "speedup_vs_k.png").exists()


def test_bench_ends_with_the_heads_training_and_best_method(tmp_path, tiny_target, capsys):
    """`make demo`'s last lines: a head whose schedule train.max_minutes cut says so, with the steps reached."""
    target = tiny_target("llama")
    torch.manual_seed(0)
    head = build_eagle(target.model)
    training = {"steps": 492, "train_seconds": 780.0, "stopped_by": "train.max_minutes", "planned_steps": 616}
    save_head(head, tmp_path / "head", head_record(head, target.identity, training=training))
    bench.main(argv=["target=tiny-llama", f"head={tmp_path / 'head'}", "max_prompts=1", "max_new_tokens=8",
                     "methods=[target,hf_greedy,eagle,eagle_dyn]", "sweep_k=[]",
                     f"output_file={tmp_path / 'bench.json'}"])
    last = capsys.readouterr().out.strip().splitlines()[-2:]
    methods = json.loads((tmp_path / "bench.json").read_text())["methods"]
    best = max(("eagle", "eagle_dyn"), key=lambda m: methods[m]["speedup"])
    assert last[0].endswith("492 training steps in 13.0 min; train.max_minutes stopped it at step 492 of 616 "
                            "(this machine trained slower than the recipe plans)")
    assert last[1] == f"its best method here: {best}, {methods[best]['speedup']:.2f}x over hf_greedy " \
                      f"(tau {methods[best]['tau']:.2f})"


def test_bench_on_heldout_prompts_with_an_eagle3_head(tmp_path, tiny_target):
    from selfspec.methods.eagle3.head import build_eagle3

    target = tiny_target("llama")
    torch.manual_seed(0)
    head = build_eagle3(target.model, vocab_size=64, draft_vocab=torch.arange(64))
    save_head(head, tmp_path / "head3", head_record(head, target.identity))
    out = tmp_path / "b3" / "bench.json"
    bench.main(argv=["target=tiny-llama", "data=tiny", "heldout_prompts=2", f"head={tmp_path / 'head3'}",
                     "max_new_tokens=10", "methods=[target,eagle3,eagle3_tree]", "sweep_k=[]",
                     f"output_file={out}"])
    report = json.loads(out.read_text())
    assert report["prompts"] == 2
    assert all(m["identical"] for m in report["methods"].values())


def test_bench_dflash_blocks_are_identical(tmp_path, tiny_target):
    from selfspec.methods.dflash.head import build_dflash

    target = tiny_target("llama")
    torch.manual_seed(0)
    head = build_dflash(target.model, block_size=4)
    save_head(head, tmp_path / "df", head_record(head, target.identity))
    out = tmp_path / "df_bench" / "bench.json"
    bench.main(argv=["target=tiny-llama", "max_prompts=1", "max_new_tokens=10", f"head={tmp_path / 'df'}",
                     "methods=[target,dflash,dflash_dyn]", "sweep_k=[1,2]", f"output_file={out}"])
    report = json.loads(out.read_text())
    assert all(m["identical"] for m in report["methods"].values())
    assert len(report["methods"]["dflash"]["accept_by_position"]) == 3  # the whole block: S-1 positions verified
    assert set(report["sweep_k"]["dflash"]) == {"1", "2"}


def test_bench_dspark_blocks_are_identical(tmp_path, tiny_target, capsys):
    """A DSpark head is a block drafter to the bench by its registry entry (Method.per_pass): its whole block of S
    drafts verified, the first K in the K sweep, and never asked for a chain longer than its block (which it would
    warn of)."""
    from selfspec.methods.dspark.head import build_dspark

    target = tiny_target("llama")
    torch.manual_seed(0)
    head = build_dspark(target.model, block_size=4, num_layers=1, markov_rank=8)
    save_head(head, tmp_path / "ds", head_record(head, target.identity))
    out = tmp_path / "ds_bench" / "bench.json"
    bench.main(argv=["target=tiny-llama", "max_prompts=1", "max_new_tokens=10", f"head={tmp_path / 'ds'}",
                     "methods=[target,dspark,dspark_dyn]", "sweep_k=[1,2]", f"output_file={out}"])
    report = json.loads(out.read_text())
    assert all(m["identical"] for m in report["methods"].values())
    assert len(report["methods"]["dspark"]["accept_by_position"]) == 4  # anchor-first: all S positions verified
    assert set(report["sweep_k"]["dspark"]) == {"1", "2"}
    assert "more than this DSpark head drafts" not in capsys.readouterr().err


def test_bench_runs_named_heads_side_by_side(tmp_path, tiny_target):
    from selfspec.methods.eagle3.head import build_eagle3

    target = tiny_target("llama")
    torch.manual_seed(0)
    e1 = build_eagle(target.model)
    e3 = build_eagle3(target.model, vocab_size=64, draft_vocab=torch.arange(64))
    save_head(e1, tmp_path / "e1", head_record(e1, target.identity))
    save_head(e3, tmp_path / "e3", head_record(e3, target.identity))
    out = tmp_path / "side" / "bench.json"
    bench.main(argv=["target=tiny-llama", "max_prompts=1", "max_new_tokens=10", "sweep_k=[2]",
                     f"+heads.first={tmp_path / 'e1'}", f"+heads.third={tmp_path / 'e3'}",
                     "methods=[target,first,first_tree,third,third_tree]", "sweep_tree=[[2,2,3],[3,2,5]]",
                     f"output_file={out}"])
    report = json.loads(out.read_text())
    assert list(report["methods"]) == ["target", "first", "first_tree", "third", "third_tree"]
    assert all(m["identical"] for m in report["methods"].values()) and report["methods"]["target"]["tau"] == 1.0
    assert all(1.0 <= report["methods"][m]["tau"] <= 6.0 for m in ("first", "third"))  # a chain of 5: 6 at most
    assert set(report["sweep_k"]) == {"first", "third"}
    assert set(report["sweep_tree"]) == {"first_tree", "third_tree"}
    assert set(report["sweep_tree"]["first_tree"]) == {"2x2x3", "3x2x5"}


def test_bench_dynamic_chains_and_their_threshold_sweep(tmp_path, tiny_target):
    target = tiny_target("llama")
    torch.manual_seed(0)
    head = build_eagle(target.model)
    save_head(head, tmp_path / "e1", head_record(head, target.identity))
    out = tmp_path / "dyn" / "bench.json"
    bench.main(argv=["target=tiny-llama", "max_prompts=1", "max_new_tokens=12", "sweep_k=[]",
                     f"+heads.first={tmp_path / 'e1'}", "methods=[target,first,first_dyn]", "dyn.num_draft=6",
                     "dyn.min_confidence=0.5", "sweep_confidence=[0.0,0.9]", f"output_file={out}"])
    report = json.loads(out.read_text())
    assert all(m["identical"] for m in report["methods"].values())
    assert len(report["methods"]["first_dyn"]["accept_by_position"]) <= 6  # the dynamic chain's own K
    assert set(report["sweep_confidence"]["first_dyn"]) == {"0.0", "0.9"}


def test_eval_heads_pools_prompts_as_training_eval_does(tmp_path, tiny_target):
    """scripts/eval_heads.py: its tau over all prompts is training's chain_acceptance over the same sequences,
    blocks and per-prompt taus are consistent with it, and a missing head list is a one-line error."""
    from selfspec.data.config import DataConfig
    from selfspec.data.tokenize import heldout_prompts
    from selfspec.eval.acceptance import chain_acceptance, greedy_continuations

    target = tiny_target("llama")
    torch.manual_seed(0)
    head = build_eagle(target.model)
    save_head(head, tmp_path / "head", head_record(head, target.identity, training={"steps": 7, "train_seconds": 90.0}))
    save_head(head, tmp_path / "chunk", head_record(head, target.identity, training={  # fine-tuned: the lineage counts
        "steps": 3, "train_seconds": 30.0, "init_from": str(tmp_path / "head"), "init_train_seconds": 90.0}))
    out = tmp_path / "eval.json"
    report = eval_heads.main(argv=["target=tiny-llama", "data=tiny", f"data.cache_dir={tmp_path / 'cache'}",
                                   f"+heads.a={tmp_path / 'head'}", f"+heads.b={tmp_path / 'head'}",
                                   f"+heads.c={tmp_path / 'chunk'}", "prompts=5",
                                   "new_tokens=16", "depth=3", "block=2", f"output_file={out}"])
    assert json.loads(out.read_text()) == report and report["prompts"] == 5
    a, b = report["heads"]["a"], report["heads"]["b"]
    assert a == b and len(a["blocks"]) == 3 and len(a["per_prompt"]) == 5
    assert a["head"] == str(tmp_path / "head") and (a["steps"], a["train_seconds"]) == (7, 90.0)  # for plot_curve
    assert (report["heads"]["c"]["steps"], report["heads"]["c"]["train_seconds"]) == (3, 120.0)
    cfg = DataConfig(path="synthetic", max_length=256, heldout_fraction=0.1, cache_dir=str(tmp_path / "cache"))
    seqs = greedy_continuations(target, heldout_prompts(cfg, target.tokenizer, 5), 16)
    whole = chain_acceptance(head.eval(), target, seqs, 3)
    assert {k: a[k] for k in whole} == {k: round(v, 3) if k == "tau" else v for k, v in whole.items()}
    assert abs(a["blocks"][2] - (a["per_prompt"][4] or 1.0)) < 1e-3  # the last block is the fifth prompt alone
    from selfspec.methods.layerskip.head import build_layerskip

    exit_head = build_layerskip(target.model, exit_layer=1, adapter="light", rank=4)
    save_head(exit_head, tmp_path / "exit", head_record(exit_head, target.identity))
    for bad in ([], [f"+heads.x={tmp_path / 'exit'}"]):  # no heads; a head this eval cannot roll out
        with pytest.raises(SystemExit) as exc:
            eval_heads.main(argv=["target=tiny-llama", "data=tiny", *bad])
        assert exc.value.code == 2


def test_eval_heads_scores_a_suites_first_turns(tmp_path, tiny_target):
    """suite=humaneval: the tau of training's chain_acceptance over the target's greedy answers to HumanEval's first
    questions; MT-Bench's prompts go round its eight categories; a suite that is not one is a one-line error."""
    from selfspec.data.suites import load_suite
    from selfspec.eval.acceptance import chain_acceptance, greedy_continuations
    from selfspec.target.model import cache_root

    target = tiny_target("llama")
    torch.manual_seed(0)
    head = build_eagle(target.model)
    save_head(head, tmp_path / "head", head_record(head, target.identity))
    report = eval_heads.main(argv=["target=tiny-llama", "suite=humaneval", f"+heads.a={tmp_path / 'head'}",
                                   "prompts=2", "new_tokens=8", "depth=2"])
    assert report["suite"] == "humaneval" and report["prompts"] == 2
    prompts = eval_heads.suite_first_turns("humaneval", None, 2)
    questions = load_suite("humaneval", cache_root(None))
    assert [p[0]["content"] for p in prompts] == [q.turns[0] for q in questions[:2]]
    whole = chain_acceptance(head.eval(), target, greedy_continuations(target, prompts, 8), 2)
    assert report["heads"]["a"]["tau"] == round(whole["tau"], 3)
    mt = {q.turns[0]: q.category for q in load_suite("mt_bench", cache_root(None))}
    cats = [mt[p[0]["content"]] for p in eval_heads.suite_first_turns("mt_bench", None, 9)]
    assert len(set(cats[:8])) == 8 and cats[8] == cats[0]
    for bad in ("suite=all", "suite=gsm8k"):
        with pytest.raises(SystemExit) as exc:
            eval_heads.main(argv=["target=tiny-llama", bad, f"+heads.a={tmp_path / 'head'}"])
        assert exc.value.code == 2


@pytest.mark.parametrize("bad, message", [
    ("num_draft=0", "num_draft must be >= 1"),
    ("sweep_k=[2,0]", "num_draft must be >= 1 (got 0)"),
    ("sweep_tree=[[3,0,8]]", "tree.top_k must be >= 1"),
    ("sweep_tree=[[3,2]]", "sweep_tree entries are [depth, top_k, total_tokens]"),
    ("tree.total_tokens=0", "tree.total_tokens must be >= 1"),
    ("max_prompts=0", "max_prompts must be >= 1"),
    ("methods=[]", "methods is empty"),
])
def test_bench_bad_options_are_one_line_and_keep_the_previous_report(tmp_path, bad, message, capsys):
    out = tmp_path / "bench.json"
    out.write_text('{"previous": "report"}\n')
    with pytest.raises(SystemExit) as e:
        bench.main(argv=["target=tiny-llama", "max_new_tokens=4", "max_prompts=1", "warmup=0",
                         "methods=[target,ngram]", f"output_file={out}", bad])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1, err
    assert out.read_text() == '{"previous": "report"}\n'


def test_bench_head_revision_reaches_the_hub_loader(tmp_path, monkeypatch, capsys):
    from selfspec.heads import checkpoint as head_checkpoint

    seen = []

    def fake_read_head(spec, revision=None):
        seen.append((spec, revision))
        raise head_checkpoint.UserError("stop here")

    monkeypatch.setattr(head_checkpoint, "read_record", fake_read_head)  # the head's type, read first
    monkeypatch.setattr(head_checkpoint, "read_head", fake_read_head)
    with pytest.raises(SystemExit):
        bench.main(argv=["target=tiny-llama", "+heads.pinned=someone/tiny-eagle", "head_revision=v2",
                         "methods=[pinned]", "warmup=0", f"output_file={tmp_path / 'b.json'}"])
    assert "stop here" in capsys.readouterr().err and seen == [("someone/tiny-eagle", "v2")]
