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
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import torch

from selfspec.decode import kv
from selfspec.decode.argmax import ScreenedArgmax
from selfspec.decode.draft import Draft, Sampling
from selfspec.decode.verify import Rng, greedy_chain, greedy_tree, probs, sample_chain, sample_tree
from selfspec.core.errors import UserError


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
    if max_new_tokens <= 0:
        raise UserError(f"max_new_tokens must be > 0 (got {max_new_tokens})")
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(1, -1)
    n = ids.shape[1]
    if n == 0:
        raise UserError("the prompt is empty")
    limit = max_positions(model)
    if limit is not None and n + max_new_tokens > limit:
        raise UserError(f"prompt ({n} tokens) + max_new_tokens ({max_new_tokens}) exceeds the target's context of "
                        f"{limit} positions; shorten the prompt or lower max_new_tokens to {max(limit - n, 0)}")
    eos = set(stop_token_ids(target) if eos_token_ids is None else eos_token_ids)
    device = next(model.parameters()).device
    cfg = kv.text_config(model)
    dtype = next(model.parameters()).dtype
    explicit_mask = kv.needs_explicit_mask(cfg)
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
    sampling = Sampling(temperature, top_k, top_p, generator)
    rng = Rng(generator)
    # greedy: the target's token ids instead of its logits (the "logits" below are then ids [1, T'])
    head = _greedy_head(model, screened_argmax) if sampling.greedy else None

    t_start = time.perf_counter()
    draft_s = verify_s = 0.0
    seq = torch.zeros(1, n + max_new_tokens + 1, dtype=torch.long, device=device)
    seq[:, :n] = ids.to(device)
    L = n
    out: list[int] = []
    stop = "length"
    proposed: list[int] = []
    accepted: list[int] = []
    passes = committed = drafted = 0

    def commit(new: Sequence[int]) -> bool:
        """Append tokens up to the budget and the first end-of-turn token; True when generation is over."""
        nonlocal L, stop
        take = list(new[: max_new_tokens - len(out)])
        for i, t in enumerate(take):
            if t in eos:
                take, stop = take[: i + 1], "eos"
                break
        seq[0, L:L + len(take)] = torch.tensor(take, dtype=torch.long)
        L += len(take)
        out.extend(take)
        if stream_callback is not None and take:
            stream_callback(take)
        return stop == "eos" or len(out) >= max_new_tokens

    # ---- prefill: the whole prompt in one pass, logits of the last position only
    t0 = time.perf_counter()
    cache = kv.new_cache()
    positions = torch.arange(n, device=device)
    mask = kv.attention_mask(cfg, 0, _causal(n), positions, dtype) if explicit_mask else None
    # The drafter's features: post-norm last hidden states, or the residual streams of `feature_layers` (EAGLE-3,
    # DFlash; decode/draft.py).
    layers = getattr(drafter, "feature_layers", None)
    h, logits = kv.decoder_forward(model, seq[:, :n], positions[None], cache, mask, logits_from=n - 1,
                                   feature_layers=layers, head=head)
    first = _choose(logits[0, -1], sampling, rng)
    verify_s += time.perf_counter() - t0
    done = commit([first])
    if drafter is not None and not done:
        t0 = time.perf_counter()
        drafter.reset(seq[:, :n])
        if hasattr(drafter, "attach_target_cache"):  # self-speculation: drafts with the target's first layers
            drafter.attach_target_cache(cache)
        drafter.observe(seq[:, :L], h, 0)
        draft_s += time.perf_counter() - t0

    while not done:
        # ---- draft: never deeper than the tokens still wanted (so positions always fit the context)
        depth_budget = max_new_tokens - len(out) - 1
        draft: Optional[Draft] = None
        if drafter is not None and depth_budget > 0:
            t0 = time.perf_counter()
            draft = drafter.propose(seq[:, :L], depth_budget, sampling)
            if draft is not None:
                draft = draft.truncated(depth_budget)
            draft_s += time.perf_counter() - t0
        if draft is not None and len(draft) == 0:
            draft = None

        # ---- verify every proposed token in one target pass: the root (last committed token) + the draft
        t0 = time.perf_counter()
        root = L - 1  # = the number of cached positions
        chain = draft is None or draft.is_chain
        node_tokens = [int(seq[0, root])] + (draft.tokens if draft is not None else [])
        depths = range(len(node_tokens)) if chain else [0] + draft.depths()
        tokens = torch.tensor([node_tokens], dtype=torch.long, device=device)
        positions = root + torch.tensor(depths, device=device)
        mask = None
        reuse = draft is not None and draft.prefix_hidden is not None  # layers < E already ran while drafting
        if explicit_mask or not chain or reuse:  # trees attend to their ancestors only; sliding layers to their window
            block = _causal(len(node_tokens)) if chain else draft.ancestor_mask()
            mask = kv.attention_mask(cfg, root, block, positions, dtype)
        if reuse:  # only layers E..L-1 run, over the drafter's layer-E states (their layers < E are cached)
            h, logits = kv.decoder_forward_from(model, draft.prefix_layers, draft.prefix_hidden, positions[None],
                                                cache, mask, feature_layers=layers, head=head)
        else:
            h, logits = kv.decoder_forward(model, tokens, positions[None], cache, mask, feature_layers=layers,
                                           head=head)
        path, nxt = _accept(draft, chain, logits[0], sampling, rng)
        verify_s += time.perf_counter() - t0

        # ---- bookkeeping and commit (stops at end-of-turn or the budget, even inside the accepted path)
        passes += 1
        if draft is not None:
            drafted += len(draft)
            max_depth = max(draft.depths())
            while len(proposed) < max_depth:
                proposed.append(0)
                accepted.append(0)
            for d in range(max_depth):
                proposed[d] += 1
            for d in range(len(path)):
                accepted[d] += 1
        new = ([draft.tokens[i - 1] for i in path] if draft is not None else []) + [nxt]
        before = len(out)
        done = commit(new)
        committed += len(out) - before
        if done:
            break

        # ---- roll back: keep the root and the accepted path in the target's cache; tell the drafter
        keep = [0] + path
        kv.keep_entries(cache, root, keep)
        if drafter is not None:
            t0 = time.perf_counter()
            drafter.observe(seq[:, :L], h[:, : len(keep)] if chain else h[:, keep], root)
            draft_s += time.perf_counter() - t0

    return Result(tokens=out, stop_reason=stop, target_passes=passes + 1, verify_passes=passes,
                  committed_by_verify=committed, proposed_by_position=proposed, accepted_by_position=accepted,
                  draft_s=draft_s, verify_s=verify_s, total_s=time.perf_counter() - t_start,
                  drafted_tokens=drafted)


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


def _choose(logits: torch.Tensor, sampling: Sampling, rng: Rng) -> int:
    """One position: its token id (greedy: `logits` is already the id) or a draw from its logits [V]."""
    if sampling.greedy:
        return int(logits)
    return rng.draw(probs(logits, sampling.temperature, sampling.top_k, sampling.top_p))


def _accept(draft: Optional[Draft], chain: bool, logits: torch.Tensor, sampling: Sampling,
            rng: Rng) -> tuple[list[int], int]:
    """logits [N + 1, V] of the verified nodes (greedy: their target token ids [N + 1]) -> (accepted node path,
    1-based; the target's next token)."""
    if draft is None:
        return [], _choose(logits[0], sampling, rng)
    if sampling.greedy:
        argmax = logits.tolist()
        if chain:
            n, nxt = greedy_chain(draft.tokens, argmax)
            return list(range(1, n + 1)), nxt
        return greedy_tree([-1] + draft.tokens, draft.children(), argmax)
    q = probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
    if chain:
        n, nxt = sample_chain(draft.tokens, q, draft.probs, rng)
        return list(range(1, n + 1)), nxt
    p = None
    if draft.probs is not None:
        # verification node i's children were drawn from the row of any of them
        p = torch.zeros(len(draft) + 1, q.shape[-1], dtype=q.dtype, device=q.device)
        for j, parent in enumerate(draft.parents):
            p[parent + 1] = draft.probs[j, : q.shape[-1]]
    return sample_tree([-1] + draft.tokens, draft.children(), q, p, rng)
