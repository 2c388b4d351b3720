"""Self-speculative drafting with a LayerSkip exit (methods/layerskip/head.py): the target's own first E layers draft.

Cache reuse (adapters `light` and `layer`): the drafter writes into the TARGET's KV cache, layers 0..E-1 only.
Each draft step runs layers 0..E-1 over one token (the root, then each drafted token) at its real position,
then the adapter and the shared norm + lm_head. One more prefix step over the last drafted token gives the
layer-E states of all N + 1 verified tokens, returned with the draft (`Draft.prefix_hidden`); the engine then
runs only layers E..L-1 over them (decode.kv.decoder_forward_from). Every layer then holds root + nodes in the
same order, so the engine's rollback (keep root + accepted path, in all layers) is exact for both halves.

    per round (chain of K):  (K + 1) x layers[0:E] over 1 token  +  K x (adapter + norm + lm_head)
                             +  1 x layers[E:L] over K + 1 tokens  + norm + lm_head
    plain decoding, per token:  1 x layers[0:L] over 1 token + norm + lm_head

The `layer` adapter is causal over the sequence: it keeps its own KV cache of layer-E states, fed with the
target's layer-E states of committed tokens (`feature_layers = [E]`: the prefill's, then the verified tokens').

Trees (`chain=False`): `depth` levels of the `top_k` exit candidates of the previous level's best node (a chain
with siblings); every node's layer-E state is computed in one prefix pass per level, under a tree mask. Children
are chosen deterministically, so sampling treats them as point masses (exact).

LoRA exits (`adapter=lora`) change layers 0..E-1 while drafting, so their keys/values are NOT the target's:
`LoraExitDrafter` keeps its own cache for those layers (like a separate draft model) and verification runs all
L layers.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from selfspec.core.errors import UserError
from selfspec.decode import kv
from selfspec.decode.draft import NUM_DRAFT, Draft, Sampling, Vocab
from selfspec.decode.drafters import load_head_for, vocab_size_of


class _ExitSampling:
    """Choosing draft tokens from exit logits over a (possibly reduced) draft vocabulary."""

    vocab: Vocab  # set by each drafter: the head's draft ids -> the target's (decode/draft.py)

    def _choose(self, logits: torch.Tensor, sampling: Sampling) -> tuple[int, Optional[torch.Tensor]]:
        """logits [V_draft] -> (target id, its [V_target] distribution or None when greedy)."""
        d, p = self.vocab.choose(logits, sampling)
        return self.vocab.target_id(d), None if p is None else self.vocab.rows(p)


class LayerSkipDrafter(_ExitSampling):
    name = "layerskip"

    def __init__(self, head, vocab_size: int, chain: bool = True, num_draft: Optional[int] = None, depth: int = 4,
                 top_k: int = 4):
        if not head.shares_target_cache:
            raise ValueError("LayerSkipDrafter shares the target's cache; LoRA exits use LoraExitDrafter")
        self.head, self.vocab = head, Vocab(vocab_size, head.draft_token_ids())
        self.chain, self.depth, self.top_k = chain, depth, top_k
        self.num_draft = NUM_DRAFT if num_draft is None else num_draft
        self.model = head.target_model
        self.E = head.exit_layer
        self.cfg = kv.text_config(self.model)
        self.dtype = next(self.model.parameters()).dtype
        # The `layer` adapter reads the target's layer-E states of committed tokens (engine: observe features).
        self.feature_layers = [self.E] if head.adapter_kind == "layer" else None
        self.cache = None  # the target's cache (attach_target_cache)
        self.adapter_cache = kv.new_cache()

    def reset(self, prompt_ids: torch.Tensor) -> None:
        self.cache = None
        self.adapter_cache = kv.new_cache()

    def attach_target_cache(self, cache) -> None:
        self.cache = cache

    def observe(self, seq: torch.Tensor, features: torch.Tensor, start: int) -> None:
        """`layer` adapter: its cache keeps the committed positions < start, then reads the committed layer-E
        states of positions start.. (features [1, T, H]); draft-time entries past `start` are dropped."""
        if self.feature_layers is None:
            return
        kv.truncate(self.adapter_cache, start)
        positions = torch.arange(start, start + features.shape[1], device=features.device)[None]
        self.head(features, positions, self.adapter_cache)

    def propose(self, seq: torch.Tensor, max_depth: int, sampling: Sampling) -> Optional[Draft]:
        if self.cache is None:
            raise RuntimeError("LayerSkipDrafter needs the engine's attach_target_cache (decode.engine.generate)")
        depth = min(self.num_draft if self.chain else self.depth, max_depth)
        if depth <= 0:
            return None
        return self._chain(seq, depth, sampling) if self.chain else self._tree(seq, depth)

    # ------------------------------------------------------------------------------------------ chain
    def _chain(self, seq: torch.Tensor, K: int, sampling: Sampling) -> Draft:
        root = seq.shape[1] - 1
        device = seq.device
        token = seq[:, root:]  # [1, 1]
        states, tokens, rows = [], [], []
        for i in range(K + 1):  # step K only computes the last draft token's layer-E state (for verification)
            pos = torch.tensor([root + i], device=device)
            h = self.head.prefix(token, pos[None], self.cache, self._mask_one(pos))  # [1, 1, H]
            states.append(h)
            if i == K:
                break
            z = self.head(h, pos[None], self.adapter_cache)  # [1, 1, H]
            t, row = self._choose(self.head.logits(z)[0, -1], sampling)
            tokens.append(t)
            if row is not None:
                rows.append(row)
            token = torch.tensor([[t]], device=device)
        draft = Draft.chain(tokens, torch.stack(rows) if rows else None)
        draft.prefix_hidden, draft.prefix_layers = torch.cat(states, dim=1), self.E
        return draft

    def _mask_one(self, pos: torch.Tensor):
        """One query at position p over the p cached positions 0..p-1 (all contiguous) plus itself."""
        return kv.attention_mask(self.cfg, int(pos[0]), torch.ones(1, 1, dtype=torch.bool), pos, self.dtype)

    # ------------------------------------------------------------------------------------------- tree
    def _tree(self, seq: torch.Tensor, depth: int) -> Draft:
        """Level d holds the top_k exit candidates after the best node of level d-1 (the root for d = 1)."""
        root = seq.shape[1] - 1
        device = seq.device
        pos = torch.tensor([root], device=device)
        h = self.head.prefix(seq[:, root:], pos[None], self.cache, self._mask_one(pos))  # the root: [1, 1, H]
        states, tokens, parents = [h], [], []
        best_state, best_index = h, -1
        for d in range(1, depth + 1):
            z = self.head(best_state, torch.tensor([[root + d - 1]], device=device), self.adapter_cache)
            logits = self.vocab.logits(self.head.logits(z)[0, -1]).float()
            k = min(self.top_k, logits.shape[-1])  # a draft vocabulary can be smaller than top_k
            cand = self.vocab.target_ids(torch.topk(logits, k).indices)  # [k]
            first = len(tokens)
            tokens += cand.tolist()
            parents += [best_index] * k
            # keys: committed 0..root-1, the root, the k nodes of each earlier level, these k nodes
            n_fed = 1 + (d - 1) * k
            allowed = torch.zeros(k, root + n_fed + k, dtype=torch.bool)
            allowed[:, : root + 1] = True
            for e in range(1, d):  # the best node of each earlier level (its first) is an ancestor
                allowed[:, root + 1 + (e - 1) * k] = True
            allowed[:, root + n_fed:] = torch.eye(k, dtype=torch.bool)
            k_pos = torch.cat([torch.arange(root + 1, device=device),
                               torch.arange(1, d, device=device).repeat_interleave(k) + root,
                               torch.full((k,), root + d, device=device)])
            q_pos = torch.full((k,), root + d, device=device)
            mask = kv.mask_from(self.cfg, allowed.to(device), q_pos, k_pos, self.dtype)
            h = self.head.prefix(cand[None].to(device), q_pos[None], self.cache, mask)  # [1, k, H]
            states.append(h)
            best_state, best_index = h[:, :1], first  # candidates come best first
        draft = Draft(tokens, parents)
        draft.prefix_hidden, draft.prefix_layers = torch.cat(states, dim=1), self.E
        return draft


class LoraExitDrafter(_ExitSampling):
    """adapter=lora: layers 0..E-1 WITH LoRA and their own cache (not the target's); a chain, verified by all L
    layers. The cache keeps the entries of tokens still committed; the rest is fed before drafting."""

    name = "layerskip"

    def __init__(self, head, vocab_size: int, num_draft: Optional[int] = None):
        self.head, self.vocab = head, Vocab(vocab_size, head.draft_token_ids())
        self.num_draft = NUM_DRAFT if num_draft is None else num_draft
        self.model = head.target_model
        self.cfg = kv.text_config(self.model)
        self.dtype = next(self.model.parameters()).dtype
        self.reset(None)

    def reset(self, prompt_ids) -> None:
        self.cache = kv.new_cache()
        self.fed = torch.zeros(0, dtype=torch.long)

    def observe(self, seq, features, start) -> None:
        pass  # reconciled in propose

    def propose(self, seq: torch.Tensor, max_depth: int, sampling: Sampling) -> Optional[Draft]:
        s = seq[0]
        L = s.shape[0]
        K = min(self.num_draft, max_depth)
        if K <= 0:
            return None
        m = min(self.fed.shape[0], L - 1)
        common = int((self.fed[:m].to(s.device) == s[:m]).long().cumprod(0).sum()) if m else 0
        kv.truncate(self.cache, common)
        with self.head.drafting():
            h = self._feed(s[common:L], common)
            self.fed = s[:L].cpu()
            tokens, rows = [], []
            for i in range(K):
                t, row = self._choose(self.head.logits(self.head(h))[0, -1], sampling)
                tokens.append(t)
                if row is not None:
                    rows.append(row)
                if i + 1 < K:
                    h = self._feed(torch.tensor([t], device=s.device), L + i)
                    self.fed = torch.cat([self.fed, torch.tensor([t])])
        return Draft.chain(tokens, torch.stack(rows) if rows else None)

    def _feed(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """Token ids [T] at positions start.. through the LoRA'd layers 0..E-1 -> h_E of the last one [1, 1, H]."""
        T = ids.shape[0]
        positions = torch.arange(start, start + T, device=ids.device)
        mask = kv.attention_mask(self.cfg, start, torch.ones(T, T, dtype=torch.bool).tril_(), positions, self.dtype)
        return self.head.prefix(ids[None], positions[None], self.cache, mask)[:, -1:]


def build(target, head: Any = None, exit_layer: Any = None, chain: bool = True, num_draft: Optional[int] = None,
          tree_depth: int = 4, tree_top_k: int = 4, head_revision: Optional[str] = None, **_):
    """A trained exit (head=), or with exit_layer=E and no head an untrained one: the target's own norm + lm_head
    on layer E. A head for another exit layer than exit_layer= is refused."""
    from selfspec.methods.layerskip.head import build_layerskip, check_exit

    if head is None and exit_layer is not None:
        head = build_layerskip(target.model, exit_layer=int(exit_layer))
    else:
        head = load_head_for(target, head, "layerskip", head_revision)
    if getattr(head, "head_type", None) != "layerskip":
        raise UserError(f"drafter=layerskip needs a layerskip head; this head is '{getattr(head, 'head_type', '?')}'")
    check_exit(head.head_config(), exit_layer)
    if not head.shares_target_cache:
        return LoraExitDrafter(head, vocab_size_of(target), num_draft=num_draft)
    return LayerSkipDrafter(head, vocab_size_of(target), chain=chain, num_draft=num_draft, depth=tree_depth,
                            top_k=tree_top_k)
