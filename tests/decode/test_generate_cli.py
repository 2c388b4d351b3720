"""decode/generate.py end to end on tiny targets: prompts in, JSONL out, one-line errors."""

from __future__ import annotations

import json

import pytest
import torch

from decode.generate import main
from decode.engine import generate
from heads.checkpoint import head_record, save_head, save_single_file
from heads.eagle import build_eagle


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
