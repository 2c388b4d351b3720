"""Reading raw conversations: shapes, roles, broken files, skip counting, the held-out split."""

import json

import pytest

from selfspec.data.config import DataConfig
from selfspec.data.conversations import (
    InvalidRecord, _embedded_sharegpt, _json_array, is_heldout, load_conversations, normalize, select_split,
)
from selfspec.core.errors import UserError


def cfg_for(tmp_path, path, **kw) -> DataConfig:
    return DataConfig(path=str(path), cache_dir=str(tmp_path / "cache"), **kw)


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def sharegpt(i, *turns):
    return {"id": f"c{i}", "conversations": [{"from": f, "value": v} for f, v in turns]}


def test_role_mapping_sharegpt_and_openai_shapes():
    for who in ("gpt", "chatgpt", "bing", "bard", "assistant"):
        _, messages, skip = normalize(sharegpt(0, ("system", "s"), ("human", "q"), (who, "a"), ("user", "q2"),
                                               (who, "a2")))
        assert skip == ""
        assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    _, messages, _ = normalize({"messages": [{"role": "user", "content": "q"},
                                             {"role": "assistant", "content": [{"type": "text", "text": "a"}]}]})
    assert messages == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    with pytest.raises(InvalidRecord, match="unknown role 'robot'"):
        normalize(sharegpt(0, ("human", "q"), ("robot", "a")))
    with pytest.raises(InvalidRecord, match="no 'conversations'"):
        normalize({"id": "x", "text": "hello"})


def test_normalize_merges_repeats_trims_edges_and_hashes_missing_ids():
    record = {"conversations": [{"from": "gpt", "value": "orphan"}, {"from": "human", "value": "a"},
                                {"from": "human", "value": "b"}, {"from": "gpt", "value": "c"},
                                {"from": "human", "value": "dangling"}]}
    conv_id, messages, skip = normalize(record)
    assert messages == [{"role": "user", "content": "a\n\nb"}, {"role": "assistant", "content": "c"}]
    assert conv_id.startswith("sha-") and conv_id == normalize(record)[0]
    assert normalize(sharegpt(1, ("human", "only a question")))[2] == "no_assistant_turn"


def test_truncated_json_array_recovers_every_complete_record(tmp_path, monkeypatch):
    import selfspec.data.conversations as conversations

    monkeypatch.setattr(conversations, "_CHUNK_CHARS", 64)  # elements straddle many chunk borders
    records = [sharegpt(i, ("human", f"question {i} é 你好 \\\"quoted\\\""), ("gpt", f"answer {i}\n" * 5))
               for i in range(30)]
    text = json.dumps(records, indent=2, ensure_ascii=False)
    cut = text.index('"c27"')  # inside record 27: records 0..26 are complete
    for end in (cut, cut + 40, len(text) - 3):
        path = tmp_path / f"cut{end}.json"
        path.write_text(text[:end], encoding="utf-8")
        got = [r for _, r in _json_array(str(path)) if isinstance(r, dict)]
        assert [r["id"] for r in got] == [f"c{i}" for i in range(len(got))]
        assert len(got) == (29 if end == len(text) - 3 else 27)
        assert got[5] == records[5]
    (tmp_path / "whole.json").write_text(text, encoding="utf-8")
    ds, stats = load_conversations(cfg_for(tmp_path, tmp_path / "whole.json"))
    assert len(ds) == 30 and stats["skipped"] == {}
    ds, stats = load_conversations(cfg_for(tmp_path, tmp_path / f"cut{cut}.json"))
    assert len(ds) == 27 and stats["skipped"] == {"truncated_record": 1}


def test_malformed_line_names_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [sharegpt(0, ("human", "q"), ("gpt", "a")), '{"id": "c1", "conv',
                                                sharegpt(2, ("human", "q"), ("gpt", "a"))])
    with pytest.raises(UserError, match=r"bad\.jsonl:2: malformed JSON"):
        load_conversations(cfg_for(tmp_path, path))
    path2 = tmp_path / "bad_array.json"
    path2.write_text('[{"id": "a", "conversations": []},\n {"id": "b", oops}]')
    with pytest.raises(UserError, match=r"bad_array\.json:2: malformed JSON"):
        load_conversations(cfg_for(tmp_path, path2))


def test_skip_invalid_counts_each_reason(tmp_path):
    good = [json.dumps(sharegpt(i, ("human", "q"), ("gpt", "a"))).encode() for i in range(3)]
    broken, alien = b'{"broken', json.dumps(sharegpt(9, ("human", "q"), ("alien", "a"))).encode()
    latin1 = b'{"id": "latin", "messages": [{"role": "user", "content": "caf\xe9"}]}'
    unanswered = json.dumps(sharegpt(10, ("human", "no answer"))).encode()
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"\n".join(good + [broken, alien, latin1, unanswered, good[0]]) + b"\n")
    with pytest.raises(UserError, match=r"mixed\.jsonl:4: malformed JSON"):
        load_conversations(cfg_for(tmp_path, path))
    ds, stats = load_conversations(cfg_for(tmp_path, path, skip_invalid=True))
    assert sorted(ds["id"]) == ["c0", "c1", "c2"]
    assert stats["skipped"] == {"malformed_json": 1, "invalid_record": 1, "not_utf8": 1, "no_assistant_turn": 1,
                                "duplicate_id": 1}
    assert stats["records"] == 8 and stats["conversations"] == 3
    path.write_bytes(b"\n".join(good + [latin1]) + b"\n")
    with pytest.raises(UserError, match=r"mixed\.jsonl:4: not UTF-8"):
        load_conversations(cfg_for(tmp_path, path))
    with pytest.raises(UserError, match=r"unknown role 'alien'"):
        load_conversations(cfg_for(tmp_path, write_jsonl(tmp_path / "alien.jsonl", [alien.decode()])))


def test_missing_file_and_empty_dataset_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_conversations(cfg_for(tmp_path, tmp_path / "nope.jsonl"))
    path = write_jsonl(tmp_path / "no_answers.jsonl", [sharegpt(i, ("human", "q")) for i in range(3)])
    with pytest.raises(UserError, match=r"no usable conversations.*no_assistant_turn': 3"):
        load_conversations(cfg_for(tmp_path, path))


def test_openai_shape_file_and_system_prompt_override(tmp_path):
    path = write_jsonl(tmp_path / "oa.jsonl", [
        {"id": "a", "messages": [{"role": "system", "content": "old"}, {"role": "user", "content": "q"},
                                 {"role": "assistant", "content": "r"}]},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "r2"}]},
    ])
    ds, _ = load_conversations(cfg_for(tmp_path, path))
    assert ds[0]["messages"][0] == {"role": "system", "content": "old"} and ds[1]["id"].startswith("sha-")
    ds, _ = load_conversations(cfg_for(tmp_path, path, system_prompt="new"))
    assert [row["messages"][0] for row in ds] == [{"role": "system", "content": "new"}] * 2


def test_heldout_split_is_deterministic_disjoint_and_keeps_pieces_together(tmp_path):
    cfg = DataConfig(path="synthetic:300", cache_dir=str(tmp_path / "cache"), heldout_fraction=0.2)
    ds, stats = load_conversations(cfg)
    train, heldout = select_split(ds, cfg, "train"), select_split(ds, cfg, "heldout")
    assert set(train["id"]).isdisjoint(heldout["id"]) and len(train) + len(heldout) == 300
    assert 30 < len(heldout) < 90
    assert heldout["id"] == select_split(load_conversations(cfg)[0], cfg, "heldout")["id"]
    assert all(is_heldout(i, 0.2) for i in heldout["id"])
    assert is_heldout("QWJhYvA_0", 0.5) == is_heldout("QWJhYvA_7", 0.5)  # pieces of one ShareGPT conversation
    with pytest.raises(UserError, match="unknown split"):
        select_split(ds, cfg, "test")


def test_max_conversations_and_synthetic_are_deterministic(tmp_path):
    cfg = DataConfig(path="synthetic", cache_dir=str(tmp_path / "cache"), max_conversations=7)
    ds, stats = load_conversations(cfg)
    assert len(ds) == 7 and stats["conversations"] == 7
    again, _ = load_conversations(DataConfig(path="synthetic", cache_dir=str(tmp_path / "other"),
                                             max_conversations=7))
    assert ds["messages"] == again["messages"]


@pytest.mark.slow
def test_embedded_sharegpt_recovers_17671_conversations():
    records = [r for _, r in _json_array(str(_embedded_sharegpt())) if isinstance(r, dict)]
    assert len(records) == 17671
    assert records[0]["id"] == "QWJhYvA_0"


def test_match_and_skip_conversations_pick_fresh_text_of_one_domain(tmp_path):
    records = [sharegpt(i, ("human", f"q{i}"), ("gpt", f"```py\nx = {i}\n```" if i % 3 == 0 else f"prose {i}"))
               for i in range(12)]
    path = write_jsonl(tmp_path / "c.jsonl", records)
    ds, stats = load_conversations(cfg_for(tmp_path, path, match="```"))
    assert ds["id"] == ["c0", "c3", "c6", "c9"] and stats["skipped"] == {"no_match": 8}
    ds, stats = load_conversations(cfg_for(tmp_path, path, match="```", skip_conversations=1, max_conversations=2))
    assert ds["id"] == ["c3", "c6"]  # the first match passed over, then two kept
    assert stats["skipped"] == {"no_match": 4, "skip_conversations": 1}
    ds, _ = load_conversations(cfg_for(tmp_path, path, skip_conversations=10))
    assert ds["id"] == ["c10", "c11"]
    with pytest.raises(UserError, match="no usable conversations"):
        load_conversations(cfg_for(tmp_path, path, skip_conversations=12))
    with pytest.raises(UserError, match=r"data.match='\(' is not a regular expression"):
        load_conversations(cfg_for(tmp_path, path / "nope", match="("))  # checked before the file is read
    with pytest.raises(UserError, match=r"need data.skip_conversations >= 0 \(a finite integer\), got -1"):
        load_conversations(cfg_for(tmp_path, path, skip_conversations=-1))
