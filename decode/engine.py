"""The speculative decoding loop: one engine for every drafter (and for none), lossless by construction.

    prefill    the target reads the prompt once: KV cache, features, the first token
    each round the drafter proposes a chain or a tree; the target verifies ALL of it in ONE pass (tree
               attention mask, position = root position + depth); decode.verify picks the accepted path plus
               one target token; the target's KV cache keeps only the accepted path; the drafter gets the
               target's features of the accepted tokens (no extra target pass)

State between rounds: `seq` holds the L committed tokens; the target's cache holds positions 0..L-2 (the last
committed token is the root of the next draft and is fed together with it).
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

import torch

from selfspec.decode import kv
from selfspec.decode.argmax import ScreenedArgmax
from selfspec.decode.draft import Draft, Sampling
from selfspec.decode.verify import Rng, greedy_chain, greedy_tree, probs, sample_chain, sample_tree
from selfspec.core.errors import UserError
from selfspec.core.threads import governor


@dataclass
class Result:
    tokens: list[int]  # generated ids, prompt excluded (an end-of-turn token that stopped it included)
    stop_reason: str  # "eos" or "length"
    target_passes: int  # target forward passes, the prefill included
    verify_passes: int  # passes after the prefill (each verified a draft, possibly empty)
    committed_by_verify: int  # tokens those passes committed (all but the prefill's one)
    proposed_by_position: list[int]  # [d - 1]: passes whose draft reached depth d
    accepted_by_position: list[int]  # [d - 1]: passes that accepted >= d draft tokens
    draft_s: float  # drafter time (propose + observe)
    verify_s: float  # target passes (prefill included) + acceptance rules
    total_s: float
    drafted_tokens: int = 0  # draft nodes sent to the target, summed over passes

    @property
    def new_tokens(self) -> int:
        return len(self.tokens)

    @property
    def tau(self) -> float:
        """Tokens committed per verification pass, bonus/correction included (plain decoding: 1.00)."""
        return self.committed_by_verify / self.verify_passes if self.verify_passes else 1.0

    @property
    def accept_by_position(self) -> list[float]:
        """[d - 1]: share of passes drafting to depth d that accepted >= d tokens (tau = 1 + sum of these when
        every pass drafts the same depth)."""
        return [a / p if p else 0.0 for a, p in zip(self.accepted_by_position, self.proposed_by_position)]

    @property
    def other_s(self) -> float:
        return max(0.0, self.total_s - self.draft_s - self.verify_s)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    def metrics(self) -> dict:
        return {"new_tokens": self.new_tokens, "tau": round(self.tau, 4), "tokens_per_s": round(self.tokens_per_s, 3),
                "target_passes": self.target_passes, "verify_passes": self.verify_passes,
                "accept_by_position": [round(a, 4) for a in self.accept_by_position],
                "draft_s": round(self.draft_s, 4), "verify_s": round(self.verify_s, 4),
                "other_s": round(self.other_s, 4), "total_s": round(self.total_s, 4), "stop_reason": self.stop_reason}


def stop_token_ids(target) -> list[int]:
    """Token ids decoding stops at by default: the tokenizer's eos and the generation config's eos ids (the
    model's own stops; data.tokenize.end_of_turn_ids is the chat TEMPLATE's end-of-turn marker, for training data)."""
    ids: set[int] = set()
    tok = getattr(target, "tokenizer", None)
    if tok is not None and tok.eos_token_id is not None:
        ids.add(int(tok.eos_token_id))
    model = getattr(target, "model", target)
    gen = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if gen is not None:
        ids.update(int(i) for i in (gen if isinstance(gen, (list, tuple)) else [gen]))
    return sorted(ids)


def max_positions(model) -> Optional[int]:
    return getattr(kv.text_config(model), "max_position_embeddings", None)


@torch.inference_mode()
def generate(target, drafter, input_ids, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: Optional[int] = None, eos_token_ids: Optional[Iterable[int]] = None,
             stream_callback: Optional[Callable[[list[int]], None]] = None, screened_argmax: bool = True) -> Result:
    """Decode up to `max_new_tokens` after `input_ids` ([n] or [1, n]) with `drafter` (None = the target alone,
    one token per pass, through the same loop). Greedy when temperature == 0, else sampling from the target's
    temperature/top-k/top-p distribution, exactly. `eos_token_ids` (default: the target's end-of-turn ids)
    stop generation, even inside an accepted draft. `stream_callback(new_ids)` after each commit. Greedy decoding
    computes only the target's argmax per position: with `screened_argmax` through decode.argmax.ScreenedArgmax
    (the same fp32 argmax, a bf16 screen plus an fp32 recheck of the few rows that could win), else from the full
    fp32 logits."""
    model = getattr(target, "model", target)
    ids = _prompt(model, input_ids, max_new_tokens)
    eos = set(stop_token_ids(target) if eos_token_ids is None else eos_token_ids)
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
    sampling = Sampling(temperature, top_k, top_p, generator)
    rng = Rng(generator)
    # greedy: the target's passes return its argmax token ids instead of its logits
    argmax = _greedy_head(model, screened_argmax) if sampling.greedy else None

    t_start = time.perf_counter()
    dec = _Decoding(model, drafter, ids, max_new_tokens, sampling, rng, argmax, eos, stream_callback)
    stats = _Stats()
    with governor() as threads:  # torch's threads sized to the cores other jobs leave free (core/threads.py)
        dec.prefill()
        while not dec.done:
            threads.tick()
            draft = dec.draft()
            verdict = dec.verify(draft)
            stats.record(draft, verdict.path, committed=dec.commit(verdict.tokens))
            if not dec.done:
                dec.rollback(verdict)

    return Result(tokens=dec.out, stop_reason=dec.stop, target_passes=stats.passes + 1, verify_passes=stats.passes,
                  committed_by_verify=stats.committed, proposed_by_position=stats.proposed,
                  accepted_by_position=stats.accepted, draft_s=dec.drafting.seconds, verify_s=dec.verifying.seconds,
                  total_s=time.perf_counter() - t_start, drafted_tokens=stats.drafted)


def _prompt(model, input_ids, max_new_tokens: int) -> torch.Tensor:
    """The prompt as [1, n] ids, once the request fits the target's context."""
    if max_new_tokens <= 0:
        raise UserError(f"max_new_tokens must be > 0 (got {max_new_tokens})")
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(1, -1)
    if ids.shape[1] == 0:
        raise UserError("the prompt is empty")
    check_fits(model, ids.shape[1], max_new_tokens)
    return ids


def check_fits(model, n: int, max_new_tokens: int, what: str = "prompt") -> None:
    """`n` prompt tokens + max_new_tokens fit the target's context, or one line saying what would make them fit
    (`what` names the prompt: "prompt 2")."""
    limit = max_positions(model)
    if limit is None or n + max_new_tokens <= limit:
        return
    # lowering max_new_tokens helps only while the prompt leaves room for a token
    fix = (f"shorten the prompt or lower max_new_tokens to {limit - n}" if n < limit else
           f"shorten the prompt to at most {limit - max_new_tokens} tokens" if max_new_tokens < limit else
           f"shorten the prompt and lower max_new_tokens below {limit}")
    raise UserError(f"{what} ({n} tokens) + max_new_tokens ({max_new_tokens}) exceeds the target's context of {limit} "
                    f"positions; {fix}")


@dataclass
class _Verdict:
    """One verification pass: what the target accepted, and what the rollback needs."""

    draft: Optional[Draft]
    chain: bool  # no draft, or a chain
    root: int  # position of the root (the last committed token) = the number of cached positions before the pass
    path: list[int]  # accepted draft nodes, 1-based (node 0 is the root)
    next_token: int  # the target's own token after the path (the bonus or the correction)
    h: torch.Tensor  # [1, N + 1, F] the target's features of the root and every draft node

    @property
    def tokens(self) -> list[int]:
        """The accepted draft tokens, then the target's own."""
        accepted = [self.draft.tokens[i - 1] for i in self.path] if self.draft is not None else []
        return accepted + [self.next_token]


class _Decoding:
    """One generate() call between its steps. `seq[:, :L]` holds the L committed tokens (the prompt, then `out`);
    the target's `cache` holds positions 0..L-2 (the last committed token is the root of the next draft and is fed
    together with it); `stop` says why it ended."""

    def __init__(self, model, drafter, ids: torch.Tensor, max_new_tokens: int, sampling: Sampling, rng: Rng,
                 argmax: Optional[ScreenedArgmax], eos: set[int],
                 stream_callback: Optional[Callable[[list[int]], None]]):
        self.model, self.drafter, self.sampling, self.rng, self.argmax = model, drafter, sampling, rng, argmax
        self.max_new_tokens, self.eos, self.stream_callback = max_new_tokens, eos, stream_callback
        self.cfg = kv.text_config(model)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.explicit_mask = kv.needs_explicit_mask(self.cfg)
        # The drafter's features: post-norm last hidden states, or the residual streams of `feature_layers` (EAGLE-3,
        # DFlash; decode/draft.py).
        self.layers = getattr(drafter, "feature_layers", None)
        n = ids.shape[1]
        self.seq = torch.zeros(1, n + max_new_tokens + 1, dtype=torch.long, device=self.device)
        self.seq[:, :n] = ids.to(self.device)
        self.L = n
        self.cache = kv.new_cache()
        self.out: list[int] = []
        self.stop = "length"
        self.drafting = _Stopwatch()  # Result.draft_s: propose + observe
        self.verifying = _Stopwatch()  # Result.verify_s: target passes + acceptance rules

    @property
    def done(self) -> bool:
        return self.stop == "eos" or len(self.out) >= self.max_new_tokens

    def prefill(self) -> None:
        """The whole prompt in one target pass (scores of its last position only), the first token, the drafter's
        start."""
        n = self.L
        with self.verifying:
            positions = torch.arange(n, device=self.device)
            mask = kv.attention_mask(self.cfg, 0, _causal(n), positions, self.dtype) if self.explicit_mask else None
            # scores: logits [1, 1, V], or greedy the target's token ids [1, 1]
            h, scores = kv.decoder_forward(self.model, self.seq[:, :n], positions[None], self.cache, mask,
                                           logits_from=n - 1, feature_layers=self.layers, head=self.argmax)
            first = _choose(scores[0, -1], self.sampling, self.rng)
        self.commit([first])
        if self.drafter is not None and not self.done:
            with self.drafting:
                self.drafter.reset(self.seq[:, :n])
                # self-speculation: the drafter runs the target's first layers, on the target's cache
                if hasattr(self.drafter, "attach_target_cache"):
                    self.drafter.attach_target_cache(self.cache)
                self.drafter.observe(self.seq[:, :self.L], h, 0)

    def draft(self) -> Optional[Draft]:
        """The drafter's chain or tree, never deeper than the tokens still wanted (so positions always fit the
        context); None for no draft (no drafter, one token left, nothing proposed)."""
        if self.drafter is None:
            return None
        with self.drafting:
            return propose_within(self.drafter, self.seq[:, :self.L], self.max_new_tokens - len(self.out) - 1,
                                  self.sampling)

    def verify(self, draft: Optional[Draft]) -> _Verdict:
        """Every proposed token in one target pass: the root (the last committed token) + the draft; then the
        acceptance rule (decode.verify) picks the accepted path and the target's next token."""
        with self.verifying:
            root = self.L - 1  # = the number of cached positions
            chain = draft is None or draft.is_chain
            node_tokens = [int(self.seq[0, root])] + (draft.tokens if draft is not None else [])
            depths = range(len(node_tokens)) if chain else [0] + draft.depths()
            tokens = torch.tensor([node_tokens], dtype=torch.long, device=self.device)
            positions = root + torch.tensor(depths, device=self.device)
            mask = None
            reuse = draft is not None and draft.prefix_hidden is not None  # layers < E already ran while drafting
            # trees attend to their ancestors only; sliding layers to their window
            if self.explicit_mask or not chain or reuse:
                block = _causal(len(node_tokens)) if chain else draft.ancestor_mask()
                mask = kv.attention_mask(self.cfg, root, block, positions, self.dtype)
            # scores: logits [1, N + 1, V], or greedy the target's token ids [1, N + 1]
            if reuse:  # only layers E..L-1 run, over the drafter's layer-E states (their layers < E are cached)
                h, scores = kv.decoder_forward_from(self.model, draft.prefix_layers, draft.prefix_hidden,
                                                    positions[None], self.cache, mask, feature_layers=self.layers,
                                                    head=self.argmax)
            else:
                h, scores = kv.decoder_forward(self.model, tokens, positions[None], self.cache, mask,
                                               feature_layers=self.layers, head=self.argmax)
            path, nxt = _accept(draft, chain, scores[0], self.sampling, self.rng)
        return _Verdict(draft, chain, root, path, nxt, h)

    def commit(self, new: Sequence[int]) -> int:
        """Append tokens up to the budget and the first end-of-turn token (even inside an accepted path); returns
        how many were taken."""
        take = list(new[: self.max_new_tokens - len(self.out)])
        for i, t in enumerate(take):
            if t in self.eos:
                take, self.stop = take[: i + 1], "eos"
                break
        self.seq[0, self.L:self.L + len(take)] = torch.tensor(take, dtype=torch.long)
        self.L += len(take)
        self.out.extend(take)
        if self.stream_callback is not None and take:
            self.stream_callback(take)
        return len(take)

    def rollback(self, verdict: _Verdict) -> None:
        """Keep the root and the accepted path in the target's cache; the drafter gets the target's features of
        those tokens (no extra target pass)."""
        keep = [0] + verdict.path
        kv.keep_entries(self.cache, verdict.root, keep)
        if self.drafter is not None:
            h = verdict.h[:, : len(keep)] if verdict.chain else verdict.h[:, keep]
            with self.drafting:
                self.drafter.observe(self.seq[:, :self.L], h, verdict.root)


def propose_within(drafter, seq: torch.Tensor, depth_budget: int, sampling: Sampling) -> Optional[Draft]:
    """`drafter`'s proposal after `seq`, cut to `depth_budget` tokens deep (the tokens still wanted minus the target's
    own); None when nothing fits or nothing is proposed (decode/replay.py replays this rule)."""
    if depth_budget <= 0:
        return None
    draft = drafter.propose(seq, depth_budget, sampling)
    if draft is not None:
        draft = draft.truncated(depth_budget)
    return draft if draft is not None and len(draft) > 0 else None


@dataclass
class _Stats:
    """Result's acceptance counts, summed over the verification passes."""

    passes: int = 0
    committed: int = 0  # tokens the passes committed
    drafted: int = 0  # draft nodes sent to the target
    proposed: list[int] = field(default_factory=list)  # [d - 1]: passes whose draft reached depth d
    accepted: list[int] = field(default_factory=list)  # [d - 1]: passes that accepted >= d draft tokens

    def record(self, draft: Optional[Draft], path: list[int], committed: int) -> None:
        self.passes += 1
        self.committed += committed
        if draft is None:
            return
        self.drafted += len(draft)
        max_depth = max(draft.depths())
        while len(self.proposed) < max_depth:
            self.proposed.append(0)
            self.accepted.append(0)
        for d in range(max_depth):
            self.proposed[d] += 1
        for d in range(len(path)):
            self.accepted[d] += 1


class _Stopwatch:
    """The wall time spent inside its `with` blocks, summed."""

    def __init__(self):
        self.seconds = 0.0

    def __enter__(self) -> None:
        self._t0 = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.seconds += time.perf_counter() - self._t0


def _causal(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril_()


_HEADS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _greedy_head(model, screened: bool) -> ScreenedArgmax:
    """h -> the target's greedy token ids; a screening ScreenedArgmax (its bf16 copy of the lm_head) is kept per
    lm_head while the weights stay the same tensor, unmodified."""
    if not screened:
        return ScreenedArgmax(model, screen=False)
    lm_head = model.get_output_embeddings()
    key = (lm_head.weight.data_ptr(), lm_head.weight._version)
    if lm_head not in _HEADS or _HEADS[lm_head][0] != key:
        _HEADS[lm_head] = (key, ScreenedArgmax(model))
    return _HEADS[lm_head][1]


def _choose(scores: torch.Tensor, sampling: Sampling, rng: Rng) -> int:
    """One position: its token id (greedy: `scores` is already the id) or a draw from its logits [V]."""
    if sampling.greedy:
        return int(scores)
    return rng.draw(probs(scores, sampling.temperature, sampling.top_k, sampling.top_p))


def _accept(draft: Optional[Draft], chain: bool, scores: torch.Tensor, sampling: Sampling,
            rng: Rng) -> tuple[list[int], int]:
    """scores of the verified nodes: logits [N + 1, V] (greedy: their target token ids [N + 1]) -> (accepted node
    path, 1-based; the target's next token)."""
    if draft is None:
        return [], _choose(scores[0], sampling, rng)
    if sampling.greedy:
        ids = scores.tolist()
        if chain:
            n, nxt = greedy_chain(draft.tokens, ids)
            return list(range(1, n + 1)), nxt
        return greedy_tree([-1] + draft.tokens, draft.children(), ids)
    q = probs(scores, sampling.temperature, sampling.top_k, sampling.top_p)
    if chain:
        n, nxt = sample_chain(draft.tokens, q, draft.probs, rng)
        return list(range(1, n + 1)), nxt
    p = None
    if draft.probs is not None:  # verification node j + 1 was drawn from the draft's row j (row 0: the root, unused)
        p = torch.cat([q.new_zeros(1, q.shape[-1]), draft.probs[:, : q.shape[-1]].to(q.dtype)])
    return sample_tree([-1] + draft.tokens, draft.children(), q, p, rng)
