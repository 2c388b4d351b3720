"""Short generated conversations (`data.path=synthetic[:n]`, the `data=tiny` option): deterministic, offline,
small enough for tiny test targets (a few hundred bytes each), and shaped like ShareGPT records (several
`from` spellings, some system prompts, some multi-turn) so they exercise the same normalisation as real data."""

from __future__ import annotations

import random
from typing import Any

_NAMES = ["Ada", "Bo", "Cy", "Dee", "Eli", "Fay", "Gus", "Hal"]
_THINGS = ["apples", "books", "cats", "pens", "stars", "boats", "keys", "cups"]
_SYSTEMS = ["You are a concise assistant.", "Answer in one sentence."]
_ASSISTANT_FROM = ["gpt", "gpt", "gpt", "chatgpt", "bard"]


def synthetic_records(n: int = 200, seed: int = 0) -> list[dict[str, Any]]:
    """n ShareGPT-shaped records; the same (n, seed) always gives the same records."""
    rng = random.Random(seed)
    return [_record(i, rng) for i in range(n)]


def _record(i: int, rng: random.Random) -> dict[str, Any]:
    turns = []
    if rng.random() < 0.2:
        turns.append({"from": "system", "value": rng.choice(_SYSTEMS)})
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        question, answer = _exchange(rng)
        turns.append({"from": rng.choice(["human", "human", "user"]), "value": question})
        turns.append({"from": rng.choice(_ASSISTANT_FROM), "value": answer})
    return {"id": f"syn{i:05d}_0", "conversations": turns}


def _exchange(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(2, 60), rng.randint(2, 60)
    name, thing = rng.choice(_NAMES), rng.choice(_THINGS)
    kind = rng.randrange(4)
    if kind == 0:
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    if kind == 1:
        return (f"{name} has {a} {thing} and gets {b} more. How many now?",
                f"{name} now has {a + b} {thing}: {a} + {b} = {a + b}.")
    if kind == 2:
        word = rng.choice(_THINGS)
        return f"Spell '{word}' backwards.", f"'{word}' backwards is '{word[::-1]}'."
    return (f"Write a list of {min(a, 4)} {thing}.",
            "\n".join(f"{k + 1}. {thing[:-1]} {k + 1}" for k in range(min(a, 4))))
