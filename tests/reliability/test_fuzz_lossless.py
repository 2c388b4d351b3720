"""Fuzzed losslessness: greedy speculative decoding equals the target's own greedy decoding (HF generate, fp32)
for random tiny targets (llama / qwen2 / gemma3 shapes, sdpa and eager attention, sliding windows), every
registered drafter with random chain lengths and tree shapes, random prompts up to the context limit, random
max_new_tokens and stop ids that land inside drafts. The cases come from harness/fuzz.py (fixed seeds, so the
run is deterministic); `fuzz_regressions.jsonl` holds cases that once failed and is replayed case by case."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from harness import fuzz

REGRESSIONS = Path(__file__).with_name("fuzz_regressions.jsonl")
SEED, PARTS, PER_PART = 0, 6, 90  # 540 cases; the parts share one pool of targets, heads and references


POOL = fuzz.Pool()
SEEN: Counter = Counter()  # coverage of the parts that ran, checked by the last test


def _explain(failures) -> str:
    return "\n".join(f"{why}\n{json.dumps(case, sort_keys=True)}" for case, why in failures[:5])


@pytest.mark.parametrize("part", range(1, PARTS + 1))
def test_fuzzed_greedy_cases_are_lossless(part):
    result = fuzz.campaign(PER_PART, SEED, pool=POOL, part=part)
    SEEN.update(result["stats"])
    SEEN["cases"] += result["cases"]
    SEEN["near_ties"] += len(result["near_ties"])
    assert not result["failures"], (f"{len(result['failures'])} failing cases (add the JSON lines to "
                                     f"{REGRESSIONS.name}):\n" + _explain(result["failures"]))


def test_fuzz_covers_every_drafter_and_the_hard_spots():
    if SEEN["cases"] < PARTS * PER_PART:
        pytest.skip("runs after the fuzz parts of this file")
    for drafter in fuzz.known_drafters():
        assert SEEN[f"drafter:{drafter}"] >= 10, drafter
    for family in fuzz.FAMILIES:
        assert SEEN[f"family:{family}"] >= 100, family
    assert SEEN["stop:eos"] >= 100 and SEEN["stop:length"] >= 100 and SEEN["stop:refused"] >= 5
    assert SEEN["eos_in_draft"] >= 10  # generation stopped at a stop id inside an accepted draft
    assert SEEN["near_limit"] >= 50  # prompt + max_new_tokens within 2 positions of the context limit
    for kind in {"eagle", "eagle3", "layerskip"} & set(fuzz.known_drafters()):  # drafts really got accepted
        assert SEEN[f"{kind}_chain_accepted"] >= 2 and SEEN[f"{kind}_tree_accepted"] >= 2, (kind, dict(SEEN))
    if "dflash" in fuzz.known_drafters():  # blocks only: no trees
        assert SEEN["dflash_chain_accepted"] >= 2, dict(SEEN)
    assert SEEN["near_ties"] == 0


def test_every_registered_drafter_is_fuzzed():
    assert fuzz.unknown_drafters() == [], "teach tests/harness/fuzz.py to build these drafters (WEIGHTS, head_specs)"


def _regressions() -> list:
    lines = [line for line in REGRESSIONS.read_text().splitlines() if line.strip()] if REGRESSIONS.exists() else []
    return [pytest.param(json.loads(line), id=f"{i}-{json.loads(line)['drafter']}") for i, line in enumerate(lines)]


@pytest.mark.parametrize("case", _regressions() or [pytest.param(None, id="none-recorded")])
def test_recorded_regressions_replay_clean(case):
    if case is None:
        pytest.skip(f"{REGRESSIONS.name} is empty")
    result = fuzz.run_case(case, POOL)
    assert result["ok"], result["why"]
