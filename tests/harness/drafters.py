"""Test-only drafters that know the target's answer, by running the target itself (no cache: tiny models).
They are not in the production registry: `register_test_drafters()` adds them to decode.drafters.DRAFTERS, so
`build_drafter("oracle", target, ...)` works in tests (tests/conftest.py) and in the fuzzer (harness/fuzz.py).

oracle        the target's own greedy continuation: a chain (width 1; greedy tau = K + 1 exactly) or a full
              tree whose nodes have the target's top-`width` tokens as children, the greedy one LAST (so the
              accepted path is never the first-children path and the KV gather of trees is exercised).
              sampled=True: children drawn i.i.d. from the target's distribution at twice the temperature,
              with those rows attached (exercises multi-draft rejection sampling with a real p).
always_wrong  a chain starting with the target's second choice (greedy tau = 1 exactly).
"""

from __future__ import annotations

from typing import Optional

import torch

from selfspec.decode import drafters
from selfspec.decode.draft import Draft, Sampling
from selfspec.decode.verify import probs


class OracleDrafter:
    name = "oracle"

    def __init__(self, model, num_draft: int = 4, width: int = 1, wrong: bool = False, sampled: bool = False):
        self.model, self.num_draft, self.width, self.wrong, self.sampled = model, num_draft, width, wrong, sampled

    def reset(self, prompt_ids) -> None:
        pass

    def observe(self, seq, features, start) -> None:
        pass

    def propose(self, seq: torch.Tensor, max_depth: int, sampling: Sampling) -> Optional[Draft]:
        tokens, parents, rows = [], [], []
        frontier = [(-1, seq[0].tolist())]
        for d in range(min(self.num_draft, max_depth)):
            nxt = []
            for node, ctx in frontier:
                logits = self.model(torch.tensor([ctx], device=seq.device)).logits[0, -1].float()
                top = torch.topk(logits, max(self.width, 2)).indices.tolist()
                if self.sampled and not sampling.greedy:
                    p = probs(logits, sampling.temperature / 4, sampling.top_k, sampling.top_p)
                    children = torch.multinomial(p.cpu(), self.width, replacement=True,
                                                 generator=sampling.generator).tolist()
                    rows += [p] * self.width
                elif self.wrong and d == 0:
                    children = [top[1]]
                elif self.width == 1:
                    children = [top[0]]
                else:
                    children = top[1:self.width] + [top[0]]
                for t in children:
                    tokens.append(t)
                    parents.append(node)
                    nxt.append((len(tokens) - 1, ctx + [t]))
            frontier = nxt
        return Draft(tokens, parents, torch.stack(rows) if rows else None)


def _oracle(target, num_draft: int = 4, width: int = 1, sampled: bool = False, **_):
    return OracleDrafter(target.model, num_draft=num_draft, width=width, sampled=sampled)


def _always_wrong(target, num_draft: int = 4, **_):
    return OracleDrafter(target.model, num_draft=num_draft, wrong=True)


TEST_DRAFTERS = {"oracle": _oracle, "always_wrong": _always_wrong}


def register_test_drafters() -> None:
    """Add `oracle` and `always_wrong` to decode.drafters' registry (again is a no-op)."""
    for name, builder in TEST_DRAFTERS.items():
        drafters.register(name, builder)
