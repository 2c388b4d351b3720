"""decode/generate.py end to end on tiny targets: prompts in, JSONL out, one-line errors."""

from __future__ import annotations

import json

import pytest
import torch

from selfspec.decode.generate import main
from selfspec.decode.engine import generate
from selfspec.heads.checkpoint import head_record, save_head, save_single_file
from selfspec.methods.eagle.head import build_eagle


def _run(args):
    return main(argv=args)


def test_prompts_file_to_jsonl_matches_the_engine(tmp_path, tiny_target, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi there"}) + "\n\n" +
                       json.dumps({"messages": [{"role": "system", "content": "Be brief."},
                                                {"role": "user", "content": "why?"}]}) + "\n")
    out = tmp_path / "o.jsonl"
    _run(["target=tiny-qwen2", "drafter=ngram", f"prompts_file={prompts}", f"output_file={out}",
          "max_new_tokens=20", "num_draft=3"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert {"prompt", "completion", "token_ids", "tau", "tokens_per_s", "target_passes"} <= set(row)
        assert 1 <= len(row["token_ids"]) <= 20
    target = tiny_target("qwen2")
    ids = target.tokenizer.apply_chat_template([{"role": "user", "content": "hi there"}], add_generation_prompt=True,
                                               tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert rows[0]["token_ids"] == generate(target, None, ids, 20).tokens
    assert capsys.readouterr().out.count("tau ") == 2  # a stats line per prompt


@pytest.mark.parametrize("form", ["folder", "head.safetensors", "head.pt"])
def test_eagle_head_checkpoint_streams(tmp_path, tiny_target, capsys, form):
    target = tiny_target("llama")
    torch.manual_seed(0)
    head = build_eagle(target.model)
    rec = head_record(head, target.identity)
    path = save_head(head, tmp_path / "h", rec) if form == "folder" else save_single_file(head, tmp_path / form, rec)
    rows = _run(["target=tiny-llama", f"head={path}", "prompt=hello", "max_new_tokens=12", "stream=true",
                 "chain=false", "tree.depth=3", "tree.top_k=2", "tree.total_tokens=6"])
    assert rows[0]["new_tokens"] == 12
    assert "tau" in capsys.readouterr().out


def test_head_of_another_target_is_refused(tmp_path, tiny_target, capsys):
    target = tiny_target("llama")
    head = build_eagle(target.model)
    path = save_head(head, tmp_path / "h", head_record(head, target.identity))
    with pytest.raises(SystemExit) as e:
        _run(["target=tiny-qwen2", f"head={path}", "prompt=hello"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "'tiny:llama'" in err and "'tiny:qwen2'" in err  # names both targets


@pytest.mark.parametrize("args, message", [
    (["max_new_tokens=0", "drafter=none", "prompt=x"], "max_new_tokens must be > 0"),
    (["drafter=eagle", "prompt=x"], "needs head="),
    (["drafter=nope", "prompt=x"], "unknown drafter 'nope'"),
    (["drafter=none"], "exactly one of prompt"),
    (["drafter=none", "prompt=x", "max_new_tokens=600"], "exceeds the target's context"),
    (["drafter=draft_model", "prompt=x"], "needs draft_model="),
])
def test_bad_input_is_one_line(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        _run(["target=tiny-llama", *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1


def test_draft_model_and_sampling(capsys):
    rows = _run(["target=tiny-gemma3", "drafter=draft_model", "draft_model=tiny:gemma3", "prompt=hello",
                 "max_new_tokens=16", "temperature=0.8", "top_p=0.9", "seed=3"])
    assert rows[0]["new_tokens"] <= 16


# ---------------------------------------------------------------------------------------------- no silent loss


@pytest.fixture
def llama_head(tmp_path, tiny_target):
    target = tiny_target("llama")
    torch.manual_seed(0)
    head = build_eagle(target.model)
    return save_head(head, tmp_path / "h", head_record(head, target.identity))


def _earlier(completion: str) -> str:
    """An earlier run's output_file: one row with every key generate writes (decode/generate.RESULTS)."""
    return json.dumps({"prompt": "hi", "completion": completion, "token_ids": [5], "tau": 1.0, "tokens_per_s": 9.0,
                       "target_passes": 1, "drafter": "none"}) + "\n"


def test_a_bad_prompt_keeps_the_previous_output(tmp_path, capsys):
    out = tmp_path / "o.jsonl"
    out.write_text(_earlier("previous results"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n" + json.dumps({"prompt": ""}) + "\n")
    with pytest.raises(SystemExit) as e:
        _run(["target=tiny-llama", "drafter=none", "chat=false", f"prompts_file={prompts}", f"output_file={out}",
              "max_new_tokens=4"])
    assert e.value.code == 2 and "prompt 2" in capsys.readouterr().err
    assert out.read_text() == _earlier("previous results")


def test_an_interrupted_run_keeps_the_previous_output(tmp_path, monkeypatch, capsys):
    import selfspec.decode.generate as gen

    out = tmp_path / "o.jsonl"
    out.write_text(_earlier("previous results"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n" + json.dumps({"prompt": "ho"}) + "\n")
    real, calls = gen.generate, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(gen, "generate", interrupted)
    with pytest.raises(SystemExit) as e:
        _run(["target=tiny-llama", "drafter=none", f"prompts_file={prompts}", f"output_file={out}",
              "max_new_tokens=4"])
    assert e.value.code == 130
    assert out.read_text() == _earlier("previous results")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp file left behind


@pytest.mark.parametrize("args, message", [
    (["drafter=ngram", "num_draft=0"], "num_draft must be >= 1"),
    (["drafter=ngram", "num_draft=-2"], "num_draft must be >= 1"),
    (["drafter=ngram", "max_ngram=1", "min_ngram=2"], "max_ngram (1) must be >= min_ngram (2)"),
    (["drafter=ngram", "min_ngram=0"], "min_ngram must be >= 1"),
    (["chain=false", "tree.top_k=0"], "tree.top_k must be >= 1"),
    (["chain=false", "tree.total_tokens=0"], "tree.total_tokens must be >= 1"),
    (["chain=false", "tree.depth=0"], "tree.depth must be >= 1"),
    (["chain=false", "tree.depth=-1"], "tree.depth must be >= 1"),
])
def test_bad_draft_options_are_one_line(args, message, llama_head, capsys):
    with pytest.raises(SystemExit) as e:
        _run(["target=tiny-llama", f"head={llama_head}", "prompt=x", "max_new_tokens=4", *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("item, message", [
    ({"messages": []}, '"messages" must be a non-empty list'),
    ({"messages": "hello"}, '"messages" must be a non-empty list'),
    ({"prompt": 3}, '"prompt" must be a string'),
    ({"prompt": None}, '"prompt" must be a string'),
    ({"messages": [{"role": "user"}]}, 'message 1 needs "role" and "content" strings'),
    ({"messages": [{"role": "user", "content": 5}]}, 'message 1 needs "role" and "content" strings'),
    ({"messages": ["hi"]}, 'message 1 needs "role" and "content" strings'),
])
def test_bad_prompt_items_are_one_line_and_touch_nothing(item, message, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps(item) + "\n")
    out = tmp_path / "o.jsonl"
    out.write_text(_earlier("old"))
    with pytest.raises(SystemExit) as e:
        _run(["target=tiny-llama", "drafter=none", f"prompts_file={prompts}", f"output_file={out}"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"{prompts}:2" in err and message in err and err.count("\n") == 1, err
    assert out.read_text() == _earlier("old")


def test_head_revision_reaches_load_head(monkeypatch, capsys):
    from selfspec.heads import checkpoint as head_checkpoint

    seen = []

    def fake_read_record(spec, revision=None):  # the head's type is read first (it picks the drafter)
        seen.append((spec, revision))
        return {"head": {"type": "eagle"}}

    def fake_read_head(spec, revision=None):  # then the head
        seen.append((spec, revision))
        raise head_checkpoint.UserError("stop here")

    monkeypatch.setattr(head_checkpoint, "read_record", fake_read_record)
    monkeypatch.setattr(head_checkpoint, "read_head", fake_read_head)
    with pytest.raises(SystemExit):
        _run(["target=tiny-llama", "head=someone/tiny-eagle", "head_revision=v1", "prompt=x"])
    assert "stop here" in capsys.readouterr().err
    assert seen == [("someone/tiny-eagle", "v1")] * 2
