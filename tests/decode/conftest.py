"""Fixtures for decode tests: tiny random targets (built once per session) and their greedy references."""

from __future__ import annotations

import functools

import pytest
import torch

from selfspec.target.model import load_target

# The CI/dev machines have 2 cores shared with other jobs; tiny models run fastest (and steadiest) on one thread.
torch.set_num_threads(1)

FAMILIES = ["llama", "qwen2", "gemma3"]


@functools.lru_cache(maxsize=None)
def tiny(family: str, seed: int = 0):
    return load_target(f"tiny:{family}", seed=seed)


def chat_prompt(target, text: str = "Tell me about speculative decoding, briefly.") -> list[int]:
    ids = target.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                               tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@functools.lru_cache(maxsize=None)
def _reference(family: str, prompt: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    """The target's own greedy decoding with HF generate (no end-of-turn stop)."""
    model = tiny(family).model
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return tuple(out[0, len(prompt):].tolist())


def greedy_reference(family: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    return list(_reference(family, tuple(prompt), max_new_tokens))


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


# Helpers as fixtures (test modules never import conftest).
@pytest.fixture
def tiny_target():
    return tiny


@pytest.fixture
def prompt_of():
    return chat_prompt


@pytest.fixture
def reference():
    return greedy_reference
