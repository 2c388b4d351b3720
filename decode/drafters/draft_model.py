"""A separate small causal LM sharing the target's tokenizer drafts a chain with its own KV cache."""

from __future__ import annotations

from typing import Optional

import torch

from selfspec.decode import kv
from selfspec.decode.draft import NUM_DRAFT, Draft, Sampling, Vocab, token_prob


class DraftModelDrafter:
    name = "draft_model"

    def __init__(self, model, vocab_size: int, num_draft: Optional[int] = None, min_confidence: float = 0.0):
        """model: a *ForCausalLM; vocab_size: the target's vocabulary (lm_head rows); a chain of num_draft tokens
        (None: NUM_DRAFT) that stops early when its confidence drops below min_confidence (decode/draft.py: dynamic
        chain length)."""
        self.model, self.vocab = model, Vocab(vocab_size)
        self.num_draft = NUM_DRAFT if num_draft is None else num_draft
        self.min_confidence = min_confidence
        self.cfg = kv.text_config(model)
        self.explicit_mask = kv.needs_explicit_mask(self.cfg)
        self.limit = getattr(self.cfg, "max_position_embeddings", None)
        self.dtype = next(model.parameters()).dtype
        self.reset(None)

    def reset(self, prompt_ids) -> None:
        self.cache = kv.new_cache()
        self.fed = torch.zeros(0, dtype=torch.long)  # the tokens whose keys are in the cache, in order

    def observe(self, seq: torch.Tensor, features: torch.Tensor, start: int) -> None:
        pass  # the draft model needs no target features; its cache is reconciled in propose

    def propose(self, seq: torch.Tensor, max_depth: int, sampling: Sampling) -> Optional[Draft]:
        s = seq[0]
        L = s.shape[0]
        K = min(self.num_draft, max_depth)
        if self.limit is not None:
            K = min(K, self.limit - L)  # the last draft token's position L - 1 + K - 1 must fit
        if K <= 0:
            return None
        # keep the cache entries whose tokens are still committed; feed the rest (at least the last token)
        m = min(self.fed.shape[0], L - 1)
        same = (self.fed[:m].to(s.device) == s[:m]).long()
        common = int(same.cumprod(0).sum()) if m else 0
        kv.truncate(self.cache, common)
        logits = self._forward(s[common:L], common)
        self.fed = s[:L].cpu()
        tokens, rows, confidence = [], [], 1.0
        for i in range(K):
            logits = self.vocab.logits(logits)  # the draft model's own vocabulary cut to the target's ids
            token, p = self.vocab.choose(logits, sampling)
            tokens.append(token)
            if p is not None:
                rows.append(self.vocab.rows(p))
            if self.min_confidence > 0:
                confidence *= token_prob(logits, token, p)
            if i + 1 == K or confidence < self.min_confidence:  # dynamic chain length (decode/draft.py)
                break
            logits = self._forward(torch.tensor([token], device=s.device), L + i)
            self.fed = torch.cat([self.fed, torch.tensor([token])])
        return Draft.chain(tokens, torch.stack(rows) if rows else None)

    def _forward(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """Feed ids at positions start.. ; -> logits [V] after the last one."""
        T = ids.shape[0]
        positions = torch.arange(start, start + T, device=ids.device)
        mask = None
        if self.explicit_mask:
            mask = kv.attention_mask(self.cfg, start, torch.ones(T, T, dtype=torch.bool).tril_(), positions,
                                     self.dtype)
        _, logits = kv.decoder_forward(self.model, ids[None], positions[None], self.cache, mask, logits_from=T - 1)
        return logits[0, -1]
