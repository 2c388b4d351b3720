"""A lookup drafter replayed over a greedy output already decoded: the passes and accepted tokens it would have had.

A lookup's draft (n-gram, suffix, its corpus) is a function of the committed text alone, and a greedy pass accepts
a draft as far as it follows the target's own continuation. So walking the engine's loop (decode/engine.py: the
prefill commits the first token; each pass drafts at most the tokens still wanted minus one, accepts the longest
path that matches the output, and commits it with the target's next token) over prompt + output gives the counts the
engine reports for that drafter, tau included, without running the target. Not for heads (their drafts depend on
the target's features) nor for sampling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from selfspec.decode.draft import Draft, Sampling

GREEDY = Sampling()


@dataclass
class Replayed:
    """Counts summed over sequences: their verification passes (engine.Result's, the prefill left out)."""

    passes: int = 0
    committed: int = 0  # tokens the passes committed (accepted drafts + the target's own)
    drafted_passes: int = 0  # passes that carried a draft
    drafted: int = 0  # draft nodes sent to the target
    sequences: int = 0  # each one's prefill committed its first token

    @property
    def tau(self) -> float:
        """Tokens a verification pass commits (engine.Result.tau)."""
        return self.committed / self.passes if self.passes else 1.0

    @property
    def accepted(self) -> int:
        return self.committed - self.passes

    @property
    def tokens_per_pass(self) -> float:
        """Generated / (generated - accepted): every target pass counted, the prefills too (the suite tables')."""
        generated = self.committed + self.sequences
        return generated / (generated - self.accepted) if generated else 1.0

    def __add__(self, other: "Replayed") -> "Replayed":
        return Replayed(self.passes + other.passes, self.committed + other.committed,
                        self.drafted_passes + other.drafted_passes, self.drafted + other.drafted,
                        self.sequences + other.sequences)


def replay(drafter, prompt: list[int], output: list[int], max_new_tokens: int) -> Replayed:
    """The counts `drafter` (a lookup: its drafts depend on the committed tokens only) would have decoding `prompt`
    greedily to `output` (the target's own greedy output: at most max_new_tokens tokens, an end-of-turn token that
    stopped it included)."""
    if not output or len(output) > max_new_tokens:
        raise ValueError(f"an output of {len(output)} tokens cannot come from max_new_tokens={max_new_tokens}")
    seq = torch.tensor([list(prompt) + list(output)], dtype=torch.long)
    n, done, counts = len(prompt), 1, Replayed(sequences=1)  # the prefill commits the first output token
    drafter.reset(seq[:, :n])
    drafter.observe(seq[:, :n + 1], None, 0)
    while done < len(output):
        budget = max_new_tokens - done - 1
        draft = drafter.propose(seq[:, :n + done], budget, GREEDY) if budget > 0 else None
        draft = draft.truncated(budget) if draft is not None and len(draft) else None
        path = _accepted(draft, output[done:]) if draft is not None else 0
        took = min(path + 1, len(output) - done)  # an end-of-turn token inside the path ends the output there
        counts += Replayed(1, took, int(draft is not None), len(draft) if draft is not None else 0)
        done += took
        drafter.observe(seq[:, :n + done], None, n + done - took - 1)
    return counts


def _accepted(draft: Draft, continuation: list[int]) -> int:
    """How deep greedy verification accepts `draft`: from the root, the child carrying the target's next token, as
    long as there is one (the target's next token is the output's, so no child past the output's end matches)."""
    children = draft.children()
    node, depth = 0, 0  # node 0 is the root, draft node i is i + 1
    while depth < len(continuation):
        nxt: Optional[int] = next((c for c in children[node] if draft.tokens[c - 1] == continuation[depth]), None)
        if nxt is None:
            break
        node, depth = nxt, depth + 1
    return depth
