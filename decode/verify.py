"""Acceptance rules of speculative decoding: small pure functions, one per rule, each exact.

Conventions shared by every rule (they are what the engine feeds them):
- A draft is a tree of N nodes under a root; the root (node 0) is the last committed token, nodes 1..N the
  proposed tokens in verification order (parents before children). `children[i]` lists the child node indices
  of node i in the order they are tried; a chain is the tree where node i's only child is i + 1.
- `target_*[i]` is the target's next-token choice (argmax, or distribution q) AFTER node i, i.e. computed
  from the context root..i. One target pass over the N + 1 nodes gives all of them.
- Every rule returns the accepted nodes (root excluded) and one more token from the target: the correction at
  the first rejection, or the bonus after the last accepted node. So each pass commits len(path) + 1 tokens.

Sampling rules draw their randomness from an `Rng` (two primitives: a biased coin and a categorical draw),
so tests can replace it with an enumerator and compute output distributions exactly.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


# --------------------------------------------------------------------------------------- logits processing


def probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Next-token distributions [..., V] from logits [..., V], the SAME processing for draft and target.

    temperature 0 = greedy: a one-hot at the argmax. Then, as in HF: scale by 1/temperature, keep the top_k
    logits (0 = all), keep the smallest set of tokens whose mass reaches top_p (the top-1 always kept).
    """
    logits = logits.float()
    if temperature <= 0:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_p = sorted_logits.softmax(-1)
        # mass strictly before each token; a token is dropped once that mass already reaches top_p
        before = sorted_p.cumsum(-1) - sorted_p
        drop = before >= top_p
        drop[..., 0] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits.softmax(-1)


# --------------------------------------------------------------------------------------------- randomness


class Rng:
    """The randomness of the sampling rules: a biased coin and a categorical draw, from a torch.Generator."""

    def __init__(self, generator: Optional[torch.Generator] = None):
        self.generator = generator

    def accept(self, prob: float) -> bool:
        if prob >= 1.0:
            return True
        return torch.rand((), generator=self.generator).item() < prob

    def draw(self, dist: torch.Tensor) -> int:
        return draw(dist, self.generator)


def draw(dist: torch.Tensor, generator: Optional[torch.Generator] = None) -> int:
    """One token from a distribution [V]; the generator lives on the CPU whatever the model's device."""
    return int(torch.multinomial(dist.detach().float().cpu(), 1, generator=generator).item())


def residual(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """normalize(max(0, q - p)): what is left of q once the draft's proposal p has been given its chance."""
    r = (q - p).clamp_(min=0)
    total = r.sum()
    # Zero mass happens only when q == p up to rounding; then any rejection was a rounding artefact: use q.
    return r / total if total > 0 else q


def remove_point(q: torch.Tensor, x: int) -> torch.Tensor:
    """normalize(q with x zeroed): the residual of q against a point-mass proposal at x."""
    r = q.clone()
    r[x] = 0
    total = r.sum()
    return r / total if total > 0 else q


# ------------------------------------------------------------------------------------------------- greedy

# Greedy chain: accept the longest prefix of the draft that equals the target's argmax at each position;
# the target's argmax at the first mismatch (or after the last draft token, the bonus) is committed too.
# target_argmax has K + 1 entries: after the root and after each draft token.
def greedy_chain(draft: Sequence[int], target_argmax: Sequence[int]) -> tuple[int, int]:
    """-> (number of draft tokens accepted, the target's next token)."""
    n = 0
    while n < len(draft) and draft[n] == target_argmax[n]:
        n += 1
    return n, target_argmax[n]


# Greedy tree: from the root, move to the child whose token is the target's argmax at the current node, as
# long as one exists (siblings hold distinct tokens, so at most one matches): the longest root-to-leaf path
# of matches. The target's argmax at the last node reached is committed too.
def greedy_tree(tokens: Sequence[int], children: Sequence[Sequence[int]],
                target_argmax: Sequence[int]) -> tuple[list[int], int]:
    """tokens[i] of node i (tokens[0], the root, unused) -> (accepted node path, the target's next token)."""
    path, node = [], 0
    while True:
        want = target_argmax[node]
        nxt = next((c for c in children[node] if tokens[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        node = nxt


# ----------------------------------------------------------------------------------------------- sampling

# Sampling chain: accept draft token x with probability min(1, q(x) / p(x)) (q target, p the distribution x
# was drawn from); on rejection draw from normalize(max(0, q - p)) and stop; after the last draft token draw
# the bonus from q. The committed tokens are distributed exactly as sampling from q token by token.
def sample_chain(draft: Sequence[int], q: torch.Tensor, p: Optional[torch.Tensor], rng: Rng) -> tuple[int, int]:
    """q [K + 1, V] target rows; p [K, V] draft rows, or None when the draft is deterministic (a point mass:
    accept with q(x), else draw from q with x removed). -> (accepted count, the next token)."""
    for i, x in enumerate(draft):
        if p is None:
            if rng.accept(float(q[i, x])):
                continue
            return i, rng.draw(remove_point(q[i], x))
        px, qx = float(p[i, x]), float(q[i, x])
        if px > 0 and rng.accept(min(1.0, qx / px)):
            continue
        return i, rng.draw(residual(q[i], p[i]))
    return len(draft), rng.draw(q[len(draft)])


# Sampling tree (multi-draft recursive rejection): at the current node with target distribution q, try its
# children in order; child x, drawn from p_x, is accepted with probability min(1, q(x) / p_x(x)) and the walk
# moves into it, else q <- normalize(max(0, q - p_x)) and the next sibling is tried. Exact whenever each sibling
# is drawn independently of the others from its own p_x: i.i.d. from one row (SpecInfer), or from different
# rows (a head's sampled child beside a lookup's deterministic one, whose p_x is the point mass at x). With
# p = None every child is a point mass (exact for ANY way of choosing them, e.g. top-k): accept x with q(x),
# else q <- normalize(q with x zeroed), which is the same rule with p_x one-hot. If every child is rejected,
# the next token is drawn from the final q (at a leaf: the bonus from q).
def sample_tree(tokens: Sequence[int], children: Sequence[Sequence[int]], q: torch.Tensor,
                p: Optional[torch.Tensor], rng: Rng) -> tuple[list[int], int]:
    """q [N + 1, V]: target row per node; p [N + 1, V]: row c = the distribution node c was drawn from (row 0,
    the root's, unused), or None (point masses). -> (accepted node path, the next token)."""
    path, node = [], 0
    while True:
        dist = q[node]
        for c in children[node]:
            x = tokens[c]
            if p is None:
                if rng.accept(float(dist[x])):
                    break
                dist = remove_point(dist, x)
            else:
                px = float(p[c, x])
                if px > 0 and rng.accept(min(1.0, float(dist[x]) / px)):
                    break
                dist = residual(dist, p[c])
        else:
            return path, rng.draw(dist)
        path.append(c)
        node = c
