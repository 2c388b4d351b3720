"""The engine is lossless for every drafter: greedy output token-identical to the target's own greedy decoding
(HF generate) on tiny llama / qwen2 / gemma3 targets; exact tau for oracle drafters; stops and limits."""

from __future__ import annotations

import pytest
import torch

from selfspec.decode import kv
from selfspec.decode.draft import Draft
from selfspec.decode.drafters import build_drafter
from selfspec.decode.engine import generate
from selfspec.methods.dflash.head import build_dflash
from selfspec.methods.eagle.head import build_eagle
from selfspec.methods.eagle3.head import build_eagle3
from selfspec.methods.peagle.head import build_peagle
from selfspec.core.errors import UserError
from tolerance import assert_close, layers

NEW = 90  # with the ~30-token chat prompt, contexts pass gemma3's 64-token sliding window


def _drafters(target, family, tiny):
    torch.manual_seed(0)
    head = build_eagle(target.model)
    small = build_eagle(target.model, vocab_size=40, draft_vocab=torch.randperm(256)[:40])  # reduced draft vocab
    e3 = build_eagle3(target.model, vocab_size=60, draft_vocab=torch.randperm(256)[:60])  # reads 3 aux layers
    own = build_eagle(target.model, layer="target")  # the family's own layer (heads before issue 48); others: Llama
    own3 = build_eagle3(target.model, vocab_size=60, draft_vocab=torch.randperm(256)[:60], layer="target")
    block = build_dflash(target.model, block_size=6, num_layers=2)  # 5 tokens per draft pass
    block_small = build_dflash(target.model, block_size=4, vocab_size=50, draft_vocab=torch.randperm(256)[:50])
    parallel = build_peagle(target.model, vocab_size=60, draft_vocab=torch.randperm(256)[:60], num_layers=2, depth=5)
    return {
        "none": {},
        "ngram": {"num_draft": 4},
        "eagle_chain": {"head": head, "num_draft": 4},
        "eagle_tree": {"head": head, "chain": False, "tree_depth": 3, "tree_top_k": 3, "tree_total_tokens": 10},
        "eagle_smallvocab": {"head": small, "chain": False, "tree_depth": 4, "tree_top_k": 2, "tree_total_tokens": 8},
        "eagle_own": {"head": own, "chain": False, "tree_depth": 3, "tree_top_k": 3, "tree_total_tokens": 10},
        "eagle3_chain": {"head": e3, "num_draft": 4},
        "eagle3_own": {"head": own3, "chain": False, "tree_depth": 3, "tree_top_k": 3, "tree_total_tokens": 10},
        "eagle3_tree": {"head": e3, "chain": False, "tree_depth": 3, "tree_top_k": 3, "tree_total_tokens": 10},
        "dflash_block": {"head": block},
        "dflash_short": {"head": block, "num_draft": 2},  # verifies the first 2 of the 5 block positions
        "dflash_smallvocab": {"head": block_small},
        "peagle_chain": {"head": parallel},
        "peagle_short": {"head": parallel, "num_draft": 2, "min_confidence": 0.01},
        "draft_model": {"draft_model": tiny(family, seed=1), "num_draft": 3},
        "oracle_chain": {"num_draft": 4},
        "oracle_tree": {"num_draft": 3, "width": 2},
        "always_wrong": {"num_draft": 3},
    }


def _name(key):
    return key.split("_")[0] if key.split("_")[0] in ("eagle", "eagle3", "dflash", "peagle", "oracle") else key


@pytest.mark.parametrize("key", ["none", "ngram", "eagle_chain", "eagle_tree", "eagle_smallvocab", "eagle_own",
                                 "eagle3_chain", "eagle3_tree", "eagle3_own", "dflash_block", "dflash_short",
                                 "dflash_smallvocab", "peagle_chain", "peagle_short", "draft_model",
                                 "oracle_chain", "oracle_tree", "always_wrong"])
def test_greedy_identical_to_target(family, key, tiny_target, prompt_of, reference):
    target = tiny_target(family)
    prompt = prompt_of(target)
    drafter = build_drafter(_name(key), target, **_drafters(target, family, tiny_target)[key])
    r = generate(target, drafter, prompt, NEW, eos_token_ids=[])
    assert r.tokens == reference(family, prompt, NEW)
    assert r.stop_reason == "length" and r.new_tokens == NEW
    assert len(prompt) + NEW > 64  # gemma3's sliding window is exercised
    if key in ("none", "always_wrong"):
        assert r.tau == 1.0 and r.verify_passes == NEW - 1


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("K", [1, 3, 5])
def test_oracle_chain_tau_is_k_plus_one(family, K, tiny_target, prompt_of, reference):
    target = tiny_target(family)
    prompt = prompt_of(target)
    rounds = 12
    new = 1 + rounds * (K + 1)  # the prefill's token, then full rounds
    r = generate(target, build_drafter("oracle", target, num_draft=K), prompt, new, eos_token_ids=[])
    assert r.tokens == reference(family, prompt, new)
    assert r.tau == K + 1 and r.verify_passes == rounds and r.target_passes == rounds + 1
    assert r.accept_by_position == [1.0] * K


def test_oracle_tree_takes_the_longest_path_not_the_first_children(tiny_target, prompt_of, reference):
    target = tiny_target("qwen2")
    prompt = prompt_of(target)
    depth, rounds = 3, 10
    new = 1 + rounds * (depth + 1)
    r = generate(target, build_drafter("oracle", target, num_draft=depth, width=3), prompt, new, eos_token_ids=[])
    assert r.tokens == reference("qwen2", prompt, new)
    assert r.tau == depth + 1
    assert r.drafted_tokens == rounds * (3 + 9 + 27)


def test_always_wrong_tau_is_one_and_text_right(tiny_target, prompt_of, reference):
    target = tiny_target("llama")
    prompt = prompt_of(target)
    r = generate(target, build_drafter("always_wrong", target, num_draft=4), prompt, 40, eos_token_ids=[])
    assert r.tokens == reference("llama", prompt, 40)
    assert r.tau == 1.0 and r.accept_by_position == [0.0] * 4


def test_eos_inside_an_accepted_draft_stops_there(tiny_target, prompt_of, reference):
    target = tiny_target("llama")
    prompt = prompt_of(target)
    ref = reference("llama", prompt, NEW)
    K = 4
    # a token whose first occurrence sits strictly inside a round (rounds commit ref[1:6], ref[6:11], ...)
    j = next(j for j in range(2, NEW) if ref.index(ref[j]) == j and (j - 1) % (K + 1) not in (0, K))
    seen = []
    r = generate(target, build_drafter("oracle", target, num_draft=K), prompt, NEW, eos_token_ids=[ref[j]],
                 stream_callback=seen.extend)
    assert r.tokens == ref[: j + 1] and r.stop_reason == "eos"
    assert seen == r.tokens  # streamed exactly what was committed


def test_eos_as_the_first_token(tiny_target, prompt_of, reference):
    target = tiny_target("qwen2")
    prompt = prompt_of(target)
    first = reference("qwen2", prompt, 1)[0]
    r = generate(target, build_drafter("oracle", target), prompt, 50, eos_token_ids=[first])
    assert r.tokens == [first] and r.stop_reason == "eos" and r.verify_passes == 0


@pytest.mark.parametrize("new", [2, 7, 8, 9])
def test_max_new_tokens_exact_even_mid_draft(new, tiny_target, prompt_of, reference):
    target = tiny_target("gemma3")
    prompt = prompt_of(target)
    for name, kw in [("oracle", {"num_draft": 5}), ("oracle", {"num_draft": 3, "width": 2}), ("ngram", {})]:
        r = generate(target, build_drafter(name, target, **kw), prompt, new, eos_token_ids=[])
        assert r.tokens == reference("gemma3", prompt, new) and r.stop_reason == "length"


def test_prompt_near_the_context_limit(tiny_target, prompt_of, reference):
    target = tiny_target("llama")
    limit = target.model.config.max_position_embeddings  # 512
    prompt = (prompt_of(target, "x" * 600))[: limit - 12]
    r = generate(target, build_drafter("oracle", target, num_draft=5), prompt, 12, eos_token_ids=[])
    assert r.tokens == reference("llama", prompt, 12)  # drafts were clamped to fit position 511
    with pytest.raises(UserError, match="exceeds the target's context of 512"):
        generate(target, None, prompt, 13)
    with pytest.raises(UserError, match="max_new_tokens must be > 0"):
        generate(target, None, prompt, 0)


def test_tree_rollback_gathers_the_accepted_path(tiny_target):
    """After verifying a tree and keeping one root-to-leaf path, the cache equals that of the path decoded
    plainly (next-token logits agree), on gemma3 with a context beyond its sliding window."""
    target = tiny_target("gemma3")
    model, cfg = target.model, target.model.config
    seq = torch.randint(0, 250, (1, 80), generator=torch.Generator().manual_seed(0))
    past = 79
    cache = kv.new_cache()
    kv.decoder_forward(model, seq[:, :past], torch.arange(past)[None], cache,
                       kv.attention_mask(cfg, 0, torch.ones(past, past, dtype=torch.bool).tril(), torch.arange(past),
                                         torch.float32))
    # root + tree: 1 -> {2, 3}; 3 -> {4}; 2 -> {5}. Keep root, 3, 4.
    draft = Draft([11, 12, 13, 14], [-1, -1, 1, 0])
    ids = torch.tensor([[int(seq[0, past]), 11, 12, 13, 14]])
    pos = past + torch.tensor([0] + draft.depths())
    kv.decoder_forward(model, ids, pos[None], cache, kv.attention_mask(cfg, past, draft.ancestor_mask(), pos,
                                                                          torch.float32))
    kv.keep_entries(cache, past, [0, 2, 3])
    assert kv.cache_length(cache) == past + 3
    nxt = torch.tensor([[7]])
    _, got = kv.decoder_forward(model, nxt, torch.tensor([[past + 3]]), cache,
                                kv.attention_mask(cfg, past + 3, torch.ones(1, 1, dtype=torch.bool),
                                                  torch.tensor([past + 3]), torch.float32))
    plain = torch.cat([seq[:, : past + 1], torch.tensor([[12, 13, 7]])], dim=1)
    want = model(plain).logits[:, -1]
    # the layers (a tree pass and cached steps against one pass), the final norm and the lm_head
    assert_close(got[:, -1], want, **layers(cfg, cfg.num_hidden_layers, positions=plain.shape[1], ops=2))
