"""scripts/data_stats.py and scripts/regenerate.py (over data/regenerate.py) run in-process on tiny targets; the data
configs compose."""

import json
from pathlib import Path

import pytest

from selfspec.data.regenerate import hf_generate, regenerate_batch, resume_ids, vllm_generate
from selfspec.scripts import data_stats, regenerate

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("option", sorted(p.stem for p in (ROOT / "conf" / "data").glob("*.yaml")))
def test_every_data_option_composes(option):
    from selfspec.core.cli import compose_config, register

    register("data_stats", data_stats.DataStatsConfig)
    overrides = [f"data={option}"] + (["data.path=x.jsonl"] if option == "jsonl" else [])
    cfg = compose_config("data_stats", overrides)
    assert cfg.data.max_length > 0 and 0 <= cfg.data.heldout_fraction < 1


def test_data_stats_prints_json_last_line(tmp_path, capsys):
    main = data_stats.main
    stats = main(["target=tiny-llama", "data=tiny", f"data.cache_dir={tmp_path}", "data.max_conversations=50"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == stats
    assert stats["conversations"] == stats["train_conversations"] + stats["heldout_conversations"] == 50
    assert 0 < stats["loss_tokens"] < stats["tokens"] and stats["skipped"] == {}


def test_data_stats_bad_input_is_one_line(tmp_path, capsys):
    main = data_stats.main
    with pytest.raises(SystemExit) as exit_:
        main(["target=tiny-llama", "data=jsonl", f"data.path={tmp_path / 'missing.jsonl'}"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().count("\n") == 0
    with pytest.raises(SystemExit):
        main(["target=tiny-llama", "data=jsonl"])
    assert capsys.readouterr().err.strip() == "error: this data option needs a file: pass data.path=FILE.jsonl"
    with pytest.raises(SystemExit):
        regenerate.main(["target=tiny-llama", "data=tiny"])
    assert capsys.readouterr().err.strip() == "error: say where to write: out=FILE.jsonl"


def read_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_regenerate_resumes_after_a_torn_line(tmp_path, capsys):
    main = regenerate.main
    out = tmp_path / "regen.jsonl"
    argv = ["target=tiny-qwen2", "data=tiny", "data.max_conversations=6", f"data.cache_dir={tmp_path}",
            f"out={out}", "max_new_tokens=6", "batch_size=4"]
    first = main(argv)
    assert first["written"] == 6
    rows = read_lines(out)
    assert len({r["id"] for r in rows}) == 6
    for row in rows:  # users' turns kept, each followed by the target's own answer
        roles = [m["role"] for m in row["messages"] if m["role"] != "system"]
        assert roles[:2] == ["user", "assistant"] and roles[-1] == "assistant"

    # An interrupted run: two lines lost, the last kept one torn mid-write.
    text = out.read_text()
    lines = text.splitlines(keepends=True)
    out.write_text("".join(lines[:3]) + lines[3][: len(lines[3]) // 2])
    second = main(argv)
    assert second["resumed"] == 3 and second["written"] == 3
    again = read_lines(out)  # every line valid JSON
    assert sorted(r["id"] for r in again) == sorted(r["id"] for r in rows)
    assert again[:3] == rows[:3]
    assert main(argv)["written"] == 0  # nothing left to do

    # The output trains as data=jsonl.
    from selfspec.data.config import DataConfig
    from selfspec.data.conversations import load_conversations

    ds, stats = load_conversations(DataConfig(path=str(out), cache_dir=str(tmp_path)))
    assert stats["conversations"] == 6


def test_regenerate_refuses_a_foreign_file(tmp_path):
    from selfspec.core.errors import UserError

    out = tmp_path / "other.jsonl"
    out.write_text("not json\n{}\n")
    with pytest.raises(UserError, match=r"other\.jsonl:1: not a line this script writes"):
        resume_ids(out)


def test_regenerate_batch_answers_each_turn_after_its_own_earlier_answers():
    import torch

    from selfspec.data.tokenize import end_of_turn_ids, resolve_chat_template
    from selfspec.target.tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer("llama")
    template = resolve_chat_template(tokenizer, None)
    stop = end_of_turn_ids(tokenizer, template)
    prompts = []

    class Scripted:  # answers "A<n>" for the n-th call, then the end-of-turn token, then padding
        def generate(self, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id, **_):
            prompts.append([tokenizer.decode(row[mask.bool()]) for row, mask in zip(input_ids, attention_mask)])
            answer = tokenizer(f"A{len(prompts)}", add_special_tokens=False)["input_ids"] + [eos_token_id[0]]
            tail = torch.tensor([answer + [pad_token_id] * 3] * len(input_ids))
            return torch.cat([input_ids, tail], dim=1)

    conversations = [
        [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "old"},
         {"role": "user", "content": "q2"}, {"role": "assistant", "content": "old"}],
        [{"role": "system", "content": "S"}, {"role": "user", "content": "p1"}, {"role": "assistant", "content": "x"}],
    ]
    generation = dict(max_new_tokens=8, eos_token_id=stop, pad_token_id=tokenizer.pad_token_id)
    totals = {"tokens": 0, "cut_turns": 0}
    out = regenerate_batch(hf_generate(Scripted(), generation, "cpu"), tokenizer, template, conversations, set(stop),
                           512, totals)
    assert out[0] == [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "A1"},
                      {"role": "user", "content": "q2"}, {"role": "assistant", "content": "A2"}]
    assert out[1] == [{"role": "system", "content": "S"}, {"role": "user", "content": "p1"},
                      {"role": "assistant", "content": "A1"}]
    assert len(prompts) == 2 and len(prompts[1]) == 1  # the second turn: only the conversation that has one
    assert "A1<|eot_id|>" in prompts[1][0] and prompts[1][0].endswith("assistant<|end_header_id|>\n\n")
    assert totals == {"tokens": 2 * 3 + 3, "cut_turns": 0}


def test_vllm_generate_asks_for_the_same_stops_and_sampling():
    """engine=vllm: one request per turn with the prompts unpadded, the end-of-turn ids as stop tokens, greedy
    unless temperature > 0 (vLLM's own generation is tested by scripts/regenerate.py engine=vllm, not here)."""
    from types import SimpleNamespace

    calls = []

    class FakeWorker:
        def generate(self, prompts, max_tokens, **kw):
            calls.append((prompts, max_tokens, kw))
            return [[7, 2] for _ in prompts]

    cfg = SimpleNamespace(max_new_tokens=5, temperature=0.0, top_p=0.9, seed=3)
    run = vllm_generate(FakeWorker(), cfg, {"eos_token_id": [2, 9]})
    assert run([[1, 2, 3], [4]]) == [[7, 2], [7, 2]]
    assert calls == [([[1, 2, 3], [4]], 5, {"temperature": 0.0, "top_p": 1.0, "stop_token_ids": [2, 9]})]


def test_regenerate_keeps_a_complete_last_record_without_newline(tmp_path):
    out = tmp_path / "regen.jsonl"
    rows = [{"id": "a", "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
            {"id": "b", "messages": [{"role": "user", "content": "z"}, {"role": "assistant", "content": "w"}]}]
    out.write_text(json.dumps(rows[0]) + "\n" + json.dumps(rows[1]))  # complete, but no trailing newline
    assert resume_ids(out) == {"a", "b"}
    assert read_lines(out) == rows and out.read_text().endswith("\n")  # the next append starts a new line


def test_regenerate_bad_options_touch_nothing(tmp_path, capsys):
    main = regenerate.main
    out = tmp_path / "regen.jsonl"
    out.write_bytes(b'{"id": "a", "messages": []}\n{"id": "b", "mess')  # a torn tail an interrupted run left
    before = out.read_bytes()
    for bad, message in [("batch_size=0", "batch_size must be >= 1"),
                         ("max_new_tokens=0", "max_new_tokens must be >= 1"),
                         ("max_turns=0", "max_turns must be >= 1"),
                         ("skip=-1", "skip must be >= 0"),
                         ("data.max_length=100000", "exceeds the target's context")]:
        with pytest.raises(SystemExit) as e:
            main(["target=tiny-llama", "data=tiny", f"data.cache_dir={tmp_path}", f"out={out}", bad])
        err = capsys.readouterr().err.strip().splitlines()[-1]  # after the datasets library's progress lines
        assert e.value.code == 2 and err.startswith("error: ") and message in err, (bad, err)
        assert out.read_bytes() == before


def test_max_length_above_the_target_context_is_refused(tmp_path):
    from selfspec.data.config import DataConfig
    from selfspec.data.tokenize import build_dataset, heldout_prompts
    from selfspec.core.errors import UserError
    from selfspec.target.model import load_target

    target = load_target("tiny:llama")  # 512 positions
    cfg = DataConfig(path="synthetic:20", max_length=4096, cache_dir=str(tmp_path))
    with pytest.raises(UserError, match=r"data.max_length=4096 exceeds the target's context of 512"):
        build_dataset(cfg, target.tokenizer, "train")
    with pytest.raises(UserError, match=r"data.max_length=4096 exceeds the target's context of 512"):
        heldout_prompts(cfg, target.tokenizer, 2)
    with pytest.raises(UserError, match=r"data.max_length=600 exceeds the target's context of 300"):
        build_dataset(DataConfig(path="synthetic:20", max_length=600, cache_dir=str(tmp_path)), target.tokenizer,
                      "train", context=300)
    for bad in (0, -5):
        with pytest.raises(UserError, match="data.max_length must be >= 1"):
            build_dataset(DataConfig(path="synthetic:20", max_length=bad, cache_dir=str(tmp_path)),
                          target.tokenizer, "train")


def test_regenerate_refuses_an_out_file_another_run_is_writing(tmp_path, capsys):
    import fcntl

    out = tmp_path / "regen.jsonl"
    with open(out, "a") as other:  # another run holds it
        fcntl.flock(other.fileno(), fcntl.LOCK_EX)
        with pytest.raises(SystemExit) as e:
            regenerate.main(["target=tiny-llama", "data=tiny", f"data.cache_dir={tmp_path}", f"out={out}",
                           "max_new_tokens=6", "data.max_conversations=4"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and "being written by another regenerate run" in err
    assert out.read_text() == ""
