"""EAGLE drafting (head.py, and the EAGLE-3 method's heads): a chain of K tokens, or an
EAGLE-2 dynamic tree. An EAGLE-3 head reads the target's aux-layer residual streams (`feature_layers`, which
the engine returns instead of post-norm features) at its first step and its own output after that.

Shift by one: the head at position t reads (target feature f_t, token x_{t+1}) and predicts f_{t+1}, whose
logits give x_{t+2}. After the target commits tokens up to position L-1 the head has read positions 0..L-2
with REAL target features; `root` is its last output (predicted f_{L-1}, logits for the token at L). Drafting
appends speculative entries (predicted features) to the head's own KV cache; `observe` crops them away and
feeds the real features of the accepted tokens instead.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch

from selfspec.core.errors import UserError
from selfspec.decode import kv
from selfspec.decode.draft import NUM_DRAFT, Draft, Sampling, Vocab, token_prob
from selfspec.decode.drafters import load_head_for, vocab_size_of


class EagleDrafter:
    name = "eagle"

    def __init__(self, head, vocab_size: int, chain: bool = True, num_draft: Optional[int] = None, depth: int = 5,
                 top_k: int = 8, total_tokens: int = 32, min_confidence: float = 0.0, siblings: int = 0,
                 sibling_depth: int = 0):
        """chain: at most K = num_draft tokens (None: NUM_DRAFT), fewer when the chain's confidence drops below
        min_confidence (see decode/draft.py: dynamic chain length); greedy, beside each of its first `sibling_depth`
        tokens the head's next `siblings` likeliest as leaves (no head step more: one row each, the hybrid's trim
        keeps those that pay). tree (EAGLE-2): `depth` levels, each expanding the top_k children of the top_k beams
        by cumulative log-prob, reranked globally to `total_tokens` nodes."""
        self.head = head
        self.name = head.head_type
        aux = getattr(head, "aux_layers", None)  # a head that reads fused target layers (EAGLE-3) names them
        self.feature_layers = list(aux) if aux is not None else None
        self.vocab = Vocab(vocab_size, head.draft_token_ids())  # draft ids -> the target's (decode/draft.py)
        self.chain, self.min_confidence = chain, min_confidence
        self.siblings, self.sibling_depth = siblings, sibling_depth
        self.num_draft = NUM_DRAFT if num_draft is None else num_draft
        self.depth, self.top_k, self.total_tokens = depth, top_k, total_tokens
        self.cache = kv.new_cache()
        self.root: Optional[torch.Tensor] = None  # [1, 1, H] head output at position L-2
        # chain: asked (tokens, scores so far) before each further step; False stops it (drafters/hybrid.py sets it)
        self.keep_drafting: Optional[Callable[[list[int], list[float]], bool]] = None

    def reset(self, prompt_ids: torch.Tensor) -> None:
        self.cache = kv.new_cache()
        self.root = None

    def observe(self, seq: torch.Tensor, features: torch.Tensor, start: int) -> None:
        """Real pairs (f_t, x_{t+1}) for t = start .. start+T-1, after dropping the speculative entries."""
        T = features.shape[1]
        kv.truncate(self.cache, start)
        positions = torch.arange(start, start + T, device=features.device)[None]
        out = self.head(features, seq[:, start + 1:start + 1 + T], positions, self.cache)
        self.root = out[:, -1:]

    def propose(self, seq: torch.Tensor, max_depth: int, sampling: Sampling) -> Optional[Draft]:
        if self.chain:
            return self._chain(seq.shape[1], min(self.num_draft, max_depth), sampling)
        return self._tree(seq.shape[1], min(self.depth, max_depth))

    # ------------------------------------------------------------------------------------------ chain
    def _chain(self, L: int, K: int, sampling: Sampling) -> Draft:
        h, tokens, rows, scores, confidence = self.root, [], [], [], 1.0
        others: list[tuple[int, int, float]] = []  # greedy: (parent, token, score) of the leaves beside the chain
        for i in range(K):
            logits = self.vocab.logits(self.head.logits(h[:, -1])[0])  # [V_draft]
            d, p = self.vocab.choose(logits, sampling)
            if p is not None:
                rows.append(self.vocab.rows(p))
            token = self.vocab.target_id(d)
            tokens.append(token)
            if p is None and i < self.sibling_depth and self.siblings:  # the next likeliest tokens, as leaves
                top = torch.topk(torch.softmax(logits.float(), -1), min(1 + self.siblings, logits.shape[-1]))
                others += [(i - 1, self.vocab.target_id(alt), confidence * prob)
                           for prob, alt in zip(top.values.tolist(), top.indices.tolist()) if alt != d][:self.siblings]
            confidence *= token_prob(logits, d, p)
            scores.append(confidence)  # Draft.scores: the chain's confidence up to this token
            if i + 1 == K or confidence < self.min_confidence:  # dynamic chain length (decode/draft.py)
                break
            if self.keep_drafting is not None and not self.keep_drafting(tokens, scores):
                break
            # the head reads (predicted f_{L-1+i}, token) at position L-1+i
            ids = torch.tensor([[token]], device=h.device)
            h = self.head(h[:, -1:], ids, torch.tensor([[L - 1 + i]], device=h.device), self.cache)
        if not others:
            return Draft.chain(tokens, torch.stack(rows) if rows else None, scores)
        return Draft(tokens + [t for _, t, _ in others], list(range(-1, len(tokens) - 1)) + [q for q, _, _ in others],
                     scores=scores + [c for _, _, c in others])

    # ------------------------------------------------------------------------------------------- tree
    def _tree(self, L: int, depth: int) -> Draft:
        """EAGLE-2: per depth, expand the top_k children of each of the top_k beams, keep as beams the top_k
        of those by cumulative log-prob; at the end keep the total_tokens best nodes overall. The children of a
        node are chosen deterministically (top-k), so verification treats them as point masses (exact)."""
        device = self.root.device
        prefix = kv.cache_length(self.cache)  # = L - 1
        logp = torch.log_softmax(self.vocab.logits(self.head.logits(self.root[:, -1])[0]).float(), -1)
        k = min(self.top_k, logp.shape[-1])  # a draft vocabulary can be smaller than top_k
        top = torch.topk(logp, k)
        tok = top.indices.tolist()  # draft-vocab ids of every node
        parent = [-1] * k
        score = top.values.tolist()
        node_depth = [1] * k
        beams = list(range(k))
        beam_scores = top.values
        beam_feat = self.root.expand(1, k, -1)  # the output that predicted each beam
        slot: dict[int, int] = {}  # node -> its entry in the head cache after the prefix
        for d in range(2, depth + 1):
            n_fed = len(slot)
            allowed = torch.zeros(k, prefix + n_fed + k, dtype=torch.bool)
            allowed[:, :prefix] = True
            for j, b in enumerate(beams):
                a = parent[b]
                while a >= 0:
                    allowed[j, prefix + slot[a]] = True
                    a = parent[a]
                allowed[j, prefix + n_fed + j] = True
                slot[b] = n_fed + j
            q_pos = torch.full((k,), prefix + d - 2, device=device)
            k_pos = torch.cat([torch.arange(prefix, device=device),
                               torch.tensor([prefix + node_depth[n] - 1 for n in sorted(slot, key=slot.get)],
                                            device=device)])
            mask = kv.mask_from(self.head.config, allowed.to(device), q_pos, k_pos, beam_feat.dtype)
            ids = self.vocab.target_ids(torch.tensor([tok[b] for b in beams], device=device))[None]
            out = self.head(beam_feat, ids, q_pos[None], self.cache, attention_mask=mask)  # [1, k, H]
            logp = torch.log_softmax(self.vocab.logits(self.head.logits(out)[0]).float(), -1)  # [k, V_draft]
            top = torch.topk(logp, k, dim=-1)
            cand = beam_scores[:, None] + top.values  # [k, k] cumulative log-probs
            first = len(tok)
            tok += top.indices.flatten().tolist()
            parent += [beams[j] for j in range(k) for _ in range(k)]
            score += cand.flatten().tolist()
            node_depth += [d] * (k * k)
            best = torch.topk(cand.flatten(), k).indices
            beams = [first + int(i) for i in best]
            beam_scores = cand.flatten()[best]
            beam_feat = out[:, best // k]
        return self._select(tok, parent, score, node_depth)

    def _select(self, tok, parent, score, node_depth) -> Draft:
        """The total_tokens best nodes (an ancestor scores >= its descendants, so the set is a tree), listed
        by depth so parents come before children."""
        order = sorted(range(len(tok)), key=lambda i: (-score[i], node_depth[i], i))
        chosen: set[int] = set()
        for i in order:
            if len(chosen) >= self.total_tokens:
                break
            if parent[i] < 0 or parent[i] in chosen:
                chosen.add(i)
        nodes = sorted(chosen, key=lambda i: (node_depth[i], i))
        index = {n: j for j, n in enumerate(nodes)}
        tokens = self.vocab.target_ids(torch.tensor([tok[n] for n in nodes])).tolist()
        # Draft.scores: each node's path probability under the head (its cumulative log-prob exponentiated), what a
        # hybrid's trim values the node by, as it does a chain's confidence
        return Draft(tokens, [index[parent[n]] if parent[n] >= 0 else -1 for n in nodes],
                     scores=[math.exp(score[n]) for n in nodes])


def build_eagle(target, head: Any = None, chain: bool = True, num_draft: Optional[int] = None, tree_depth: int = 5,
                tree_top_k: int = 8, tree_total_tokens: int = 32, min_confidence: float = 0.0,
                head_revision: Optional[str] = None, siblings: int = 0, sibling_depth: int = 0, **_):
    head = load_head_for(target, head, "eagle", head_revision)
    if getattr(head, "head_type", "eagle") != "eagle":
        raise UserError(f"drafter=eagle needs an EAGLE head; this head is '{head.head_type}' "
                        f"(use drafter={head.head_type})")
    return EagleDrafter(head, vocab_size_of(target), chain=chain, num_draft=num_draft, depth=tree_depth,
                        top_k=tree_top_k, total_tokens=tree_total_tokens, min_confidence=min_confidence,
                        siblings=siblings, sibling_depth=sibling_depth)
