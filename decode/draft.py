"""What a drafter proposes (`Draft`: a chain or a tree of tokens) and the small interface every drafter has.

A drafter is any object with these methods (duck-typed; see decode/drafters/ for the implementations):

    reset(prompt_ids: LongTensor [1, n]) -> None
        A new sequence starts.
    observe(seq: LongTensor [1, L], features: Tensor [1, T, H], start: int) -> None
        The target committed tokens: `seq` is the whole committed sequence; `features` are the target's
        post-norm last hidden states at positions start .. L - 2 (the positions whose next token is now known;
        start = 0 after the prefill, the previous L - 1 after each verification pass). Drafters that keep a KV
        cache roll it back here; EAGLE heads consume the features (no extra target pass).
    propose(seq: LongTensor [1, L], max_depth: int, sampling: Sampling) -> Draft | None
        Propose at most `max_depth` tokens deep beyond seq (None or an empty draft: nothing to propose).

Dynamic chain length (`min_confidence` of the chain drafters; 0 = always the full chain): after drawing a token,
a drafter multiplies its running confidence by that token's draft probability and stops the chain when the product
falls below min_confidence. The product estimates the chance the whole chain is accepted, so low-confidence tails
(which cost a draft step and a verified position each) are not proposed. It stays exact under sampling because the
decision about position i+1 depends only on the tokens drawn at positions <= i: each proposed token is still an
unconditioned draw from its row of `probs`. (Stopping on a token's own probability *before* keeping it would not be:
the kept tokens would be biased towards likely ones.)

Attribute `feature_layers` (optional list of `output_hidden_states` indices): the engine then runs the target with
hidden states on and passes their concatenation [1, T, len * H] as `features` instead (EAGLE-3's aux layers, DFlash's
context layers), for the same committed positions.

Attribute `name` (str). Drafters hold no reference to the target's KV cache, except self-speculative ones
(LayerSkip), which draft with the target's own first layers and share its cache through one optional hook:

    attach_target_cache(cache: DynamicCache) -> None
        Called after `reset`. The drafter may append entries for layers 0..E-1 only, and only for the tokens of
        the draft it then returns: root and every node, in the draft's order, so that the engine's rollback
        (which keeps the root and the accepted path in every layer) leaves all layers consistent.
    Draft.prefix_hidden / Draft.prefix_layers
        Set on such a draft: the residual stream after E = prefix_layers layers for the root and every node,
        [1, N + 1, H]. Verification then runs only layers E..L-1 over them (decode.kv.decoder_forward_from).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

# Draft tokens per verification pass when none is given (num_draft null or left out), for every chain drafter: EAGLE,
# EAGLE-3, LayerSkip, n-gram and a draft model. DFlash drafts its whole block, P-EAGLE its trained depth. bench and
# serve_bench start from it too; stated here only.
NUM_DRAFT = 5


@dataclass
class Sampling:
    """How tokens are chosen; drafters process their logits exactly like the target (decode.verify.probs)."""

    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0
    top_p: float = 1.0
    generator: Optional[torch.Generator] = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


@dataclass
class Draft:
    """N proposed nodes under the root (the last committed token), parents listed before their children.

    tokens  [N] target-vocabulary ids.
    parents [N] index of each node's parent among these N nodes, -1 = the root.
    probs   None when the proposal is deterministic given the drafter's state (greedy, top-k trees, prompt
            lookup): verification then treats each node as a point mass. Otherwise [N, V] float, row i = the
            distribution node i was drawn from (siblings drawn i.i.d. from the same row).
    scores  None, or [N] the drafter's estimate that verification accepts node i (its whole path: the product of
            its tokens' draft probabilities, a lookup's empirical path probability), never above its parent's.
            Advisory only: what a drafter may cut (decode/drafters/hybrid.py), never what verification reads.
    """

    tokens: list[int]
    parents: list[int]
    probs: Optional[torch.Tensor] = None
    # Self-speculation: layer-`prefix_layers` states [1, N + 1, H] of the root and nodes, whose layers
    # 0..prefix_layers-1 are already in the target's cache (see the module docstring). None: verify all layers.
    prefix_hidden: Optional[torch.Tensor] = None
    prefix_layers: int = 0
    scores: Optional[list[float]] = None

    @staticmethod
    def chain(tokens: list[int], probs: Optional[torch.Tensor] = None,
              scores: Optional[list[float]] = None) -> "Draft":
        return Draft(list(tokens), list(range(-1, len(tokens) - 1)), probs, scores=scores)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def depths(self) -> list[int]:
        """Depth of each node (children of the root: 1)."""
        d: list[int] = []
        for p in self.parents:
            d.append(1 if p < 0 else d[p] + 1)
        return d

    def children(self) -> list[list[int]]:
        """children[i] of verification node i (0 = root, node j of the draft = j + 1), in proposal order."""
        ch: list[list[int]] = [[] for _ in range(len(self.tokens) + 1)]
        for j, p in enumerate(self.parents):
            ch[p + 1].append(j + 1)
        return ch

    def ancestor_mask(self) -> torch.Tensor:
        """[N + 1, N + 1] bool, row i True at i and its ancestors (root included): who node i attends to."""
        n = len(self.tokens) + 1
        m = torch.zeros(n, n, dtype=torch.bool)
        m[0, 0] = True
        for j, p in enumerate(self.parents):
            m[j + 1] = m[p + 1]
            m[j + 1, j + 1] = True
        return m

    def truncated(self, max_depth: int) -> "Draft":
        """Keep the nodes at depth <= max_depth (parents stay before children, indices remapped)."""
        depths = self.depths()
        if not depths or max(depths) <= max_depth:
            return self
        return self.subset([i for i, d in enumerate(depths) if d <= max_depth])

    def subset(self, keep: list[int]) -> "Draft":
        """The nodes `keep` (ascending indices, each node's parent kept too), indices remapped; probs and scores
        follow their nodes."""
        if self.prefix_hidden is not None:  # its nodes are already in the target's cache: it must fit as proposed
            raise ValueError("a draft that shares the target's cache must be verified as proposed")
        new_index = {old: new for new, old in enumerate(keep)}
        if any(self.parents[i] >= 0 and self.parents[i] not in new_index for i in keep):
            raise ValueError("Draft.subset: a kept node's parent is not kept")
        return Draft([self.tokens[i] for i in keep], [new_index.get(self.parents[i], -1) for i in keep],
                     None if self.probs is None else self.probs[keep],
                     scores=None if self.scores is None else [self.scores[i] for i in keep])


def merge(a: Draft, b: Draft) -> Draft:
    """One draft holding `a` and the point-mass draft `b` (a lookup's: b.probs is None) under the same root, for ONE
    verification pass. When `a` is deterministic too (greedy, top-k trees) the two share their common prefixes: a
    node of b whose parent is shared and whose token a node of a already has there becomes that node (siblings stay
    distinct). When `a` was sampled (a.probs rows) b stays a separate branch and each of its nodes gets the point
    mass at its token as its row: merging a drawn node with a fixed one would bias the draw; side by side, each
    sibling is still drawn independently of the others from its own row, which keeps decode.verify.sample_tree
    exact."""
    if b.probs is not None:
        raise ValueError("merge: the second draft must be deterministic (a lookup's point masses)")
    if a.prefix_hidden is not None or b.prefix_hidden is not None:
        raise ValueError("merge: a draft sharing the target's cache cannot take a second branch")
    tokens, parents = list(a.tokens), list(a.parents)
    scored = a.scores is not None and b.scores is not None
    scores = list(a.scores) if scored else []
    shared = a.probs is None
    at = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens))} if shared else {}
    where: list[int] = []  # b's node j -> its index in the merged draft
    for j, (t, p) in enumerate(zip(b.tokens, b.parents)):
        parent = where[p] if p >= 0 else -1
        i = at.get((parent, t)) if shared else None
        if i is None:
            i = len(tokens)
            tokens.append(t)
            parents.append(parent)
            at[(parent, t)] = i
            scores.append(0.0)
        if scored:  # a node both propose: the likelier estimate (a sure lookup beside an unsure head, or the reverse)
            scores[i] = max(scores[i], b.scores[j])
        where.append(i)
    probs = None
    if not shared:
        extra = len(tokens) - len(a.tokens)
        points = a.probs.new_zeros(extra, a.probs.shape[-1])
        points[torch.arange(extra), torch.tensor(tokens[len(a.tokens):], dtype=torch.long)] = 1.0
        probs = torch.cat([a.probs, points])
    return Draft(tokens, parents, probs, scores=scores if scored else None)


def token_prob(logits: torch.Tensor, token: int, row: Optional[torch.Tensor]) -> float:
    """The drafter's probability of the token it drew: from `row` when sampling, else softmax(logits) (greedy)."""
    return float(row[token]) if row is not None else float(torch.softmax(logits.float(), -1)[token])


class Vocab:
    """The one mapping from a drafter's vocabulary to the target's, used by every drafter.

    draft_ids [V_draft]: the target id of each draft id (a reduced draft vocabulary, heads/vocab.py), or None: draft
    ids ARE target ids. Then a drafter's rows may be longer than the target's `vocab_size` (a padded embedding or
    another model's vocabulary): the extra LOGITS are cut before any softmax, so no probability and no draw lands on
    an id the target cannot emit; or shorter: the missing ids get probability 0."""

    def __init__(self, vocab_size: int, draft_ids: Optional[torch.Tensor] = None):
        self.vocab_size, self.draft_ids = int(vocab_size), draft_ids

    def logits(self, logits: torch.Tensor) -> torch.Tensor:
        """A drafter's logits [..., V'] as the rows it may choose from (cut to the target's ids)."""
        return logits if self.draft_ids is not None else logits[..., : self.vocab_size]

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.draft_ids is None else self.draft_ids.to(draft_ids.device)[draft_ids]

    def target_id(self, draft_id: int) -> int:
        return draft_id if self.draft_ids is None else int(self.draft_ids[draft_id])

    def rows(self, p: torch.Tensor) -> torch.Tensor:
        """Draft distributions [..., V'] drawn over `logits(...)` -> the same over the target's ids
        [..., vocab_size]."""
        if self.draft_ids is not None:
            return p.new_zeros(*p.shape[:-1], self.vocab_size).index_copy_(-1, self.draft_ids.to(p.device), p)
        if p.shape[-1] > self.vocab_size:
            raise ValueError(f"a draft distribution over {p.shape[-1]} ids for a {self.vocab_size}-id target: "
                             "draw from Vocab.logits(...), which cuts the ids the target cannot emit")
        return torch.nn.functional.pad(p, (0, self.vocab_size - p.shape[-1]))

    def choose(self, logits: torch.Tensor, sampling: Sampling) -> tuple[int, Optional[torch.Tensor]]:
        """One draft id from a drafter's logits [V'] -> (draft id, the processed draft distribution it was drawn
        from, None when greedy). Map with target_id / rows."""
        from selfspec.decode.verify import draw, probs

        logits = self.logits(logits)
        if sampling.greedy:
            return int(logits.argmax()), None
        p = probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
        return draw(p, sampling.generator), p



def independent_draft(vocab: Vocab, logits: torch.Tensor, sampling: Sampling, min_confidence: float = 0.0) -> Draft:
    """A chain whose K tokens are drafted independently, one per row of `logits` [K, V_draft] (DFlash's block,
    P-EAGLE's depths: no row sees another's token): greedy takes each row's argmax (a point mass), sampling draws
    each from its own processed row and keeps that row, which keeps decode.verify's chain rule exact. With
    min_confidence, the chain stops after the token that brings its running confidence below it."""
    from selfspec.decode.verify import draw, probs

    k = logits.shape[0]
    rows = None
    if sampling.greedy:
        drafted = logits.argmax(-1).tolist()
    else:
        rows = probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)  # [K, V_draft]
        drafted = [draw(rows[i], sampling.generator) for i in range(k)]
    # each token's probability in its row, and the chain's running confidence (Draft.scores)
    index = torch.arange(k, device=logits.device), torch.tensor(drafted, device=logits.device)
    p = (rows if rows is not None else torch.softmax(logits.float(), -1))[index]
    scores = torch.cumprod(p.double(), 0).tolist()
    if min_confidence > 0:  # keep a token, then stop if the chain so far is unlikely to be accepted
        k = next((i + 1 for i, c in enumerate(scores) if c < min_confidence), k)
    tokens = vocab.target_ids(torch.tensor(drafted[:k], dtype=torch.long)).tolist()
    return Draft.chain(tokens, None if rows is None else vocab.rows(rows[:k]), scores[:k])
