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

import torch

from selfspec.decode.draft import Draft, Sampling
from selfspec.decode.engine import propose_within
from selfspec.decode.verify import greedy_tree

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
    def generated(self) -> int:
        """Tokens decoded: the passes' and each sequence's prefill's."""
        return self.committed + self.sequences

    @property
    def tokens_per_pass(self) -> float:
        """Generated / (generated - accepted): every target pass counted, the prefills too (the suite tables')."""
        return self.generated / (self.generated - self.accepted) if self.generated else 1.0

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
        draft = propose_within(drafter, seq[:, :n + done], max_new_tokens - done - 1, GREEDY)
        path = _accepted(draft, output[done:]) if draft is not None else 0
        took = min(path + 1, len(output) - done)  # an end-of-turn token inside the path ends the output there
        counts += Replayed(1, took, int(draft is not None), len(draft) if draft is not None else 0)
        done += took
        drafter.observe(seq[:, :n + done], None, n + done - took - 1)
    return counts


def _accepted(draft: Draft, continuation: list[int]) -> int:
    """How deep greedy verification (decode.verify.greedy_tree, a chain included) accepts `draft` when the target's
    token after a node at depth d is the output's continuation[d]: past the output's end no token (-1) matches."""
    after = [continuation[d] if d < len(continuation) else -1 for d in [0] + draft.depths()]
    path, _ = greedy_tree([-1] + draft.tokens, draft.children(), after)
    return len(path)
