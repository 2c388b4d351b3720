"""DFlash head: layer ids, the training call's block mask and positions, decoding == training, vocabulary maps,
save/load, a bf16 target, and the one-line refusals."""

import pytest
import torch
from tokenizers import AddedToken

from selfspec.core.errors import UserError
from selfspec.target.model import load_target
from selfspec.heads.checkpoint import head_record, load_head, save_head, save_single_file, signed
from selfspec.methods.dflash.head import build_dflash, default_mask_token_id, default_target_layer_ids
from same_kernels import as_loaded
from tolerance import assert_close, close, layers, terms

FAMILIES = ["llama", "qwen2", "gemma3"]
QK_NORMS = 2  # a Qwen3 layer's two reductions beyond tolerance.LAYER_OPS: q_norm, k_norm


def _tol(target, head, positions, logits=False):
    """tests/tolerance.py's k and ops for the head's output: fc and hidden_norm, its Qwen3 layers, and for logits its
    final norm and the lm_head."""
    n = len(head.layers)
    return layers(target.model.config, n, width=head.fc.in_features, positions=positions,
                  ops=2 + QK_NORMS * n + 2 * logits)


@pytest.fixture(scope="module")
def llama():
    return load_target("tiny:llama", tiny={"num_hidden_layers": 4})


def _head(target, **kw):
    torch.manual_seed(0)
    kw.setdefault("target_layer_ids", [0, 2])
    return build_dflash(target.model, block_size=4, num_layers=2, tokenizer=target.tokenizer, **kw).eval()


def _ctx(target, head, ids):
    with torch.no_grad():
        return head.context(head.target_states(target.model(ids, output_hidden_states=True).hidden_states))


def test_layer_ids_are_layer_outputs_and_default_spread(llama):
    # z-lab's build_target_layer_ids for SmolLM2-135M (30 layers): [1, 8, 14, 20, 27] for 5
    assert default_target_layer_ids(30, 5) == [1, 8, 14, 20, 27] and default_target_layer_ids(30, 3) == [1, 14, 27]
    assert default_target_layer_ids(30, 1) == [15] and default_target_layer_ids(2, 3) == [0]
    head = _head(llama)
    hs = llama.model(torch.randint(0, 250, (1, 5)), output_hidden_states=True).hidden_states
    assert torch.equal(head.target_states(hs), torch.cat([hs[1], hs[3]], -1))  # id i = hidden_states[i + 1]
    assert head.fc.in_features == 128 and head.head_config() == {
        "type": "dflash", "block_size": 4, "num_layers": 2, "target_layer_ids": [0, 2], "mask_token_id": 261,
        "vocab_size": None}


def test_state_dict_names_map_to_qwen3(llama):
    keys = set(_head(llama).state_dict())
    per_layer = {"input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
                 "mlp.up_proj.weight", "mlp.down_proj.weight",
                 *(f"self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"))}
    layers = {f"layers.{i}.{k}" for i in (0, 1) for k in per_layer}
    assert keys == {"fc.weight", "hidden_norm.weight", "norm.weight"} | layers


@pytest.mark.parametrize("family", FAMILIES)
def test_shapes(family):
    t = load_target(f"tiny:{family}")
    head = build_dflash(t.model, tokenizer=t.tokenizer).eval()  # defaults: block 8, 3 layers
    ids = torch.randint(0, 250, (2, 30))
    ctx = _ctx(t, head, ids)
    anchors, valid = torch.tensor([[0, 5, 29], [12, -1, 7]]), torch.tensor([[True, True, True], [True, False, True]])
    hidden = head(ctx, ids, anchors, valid)  # an invalid anchor may hold anything
    assert ctx.shape == (2, 30, 64) and hidden.shape == (2, 3, 8, 64)
    assert head.logits(hidden[:, :, 1:]).shape == (2, 3, 7, 320) and torch.isfinite(hidden).all()


def test_block_sees_context_before_its_anchor_only(llama):
    head = _head(llama)
    ids = torch.randint(0, 250, (1, 24))
    ctx = _ctx(llama, head, ids)
    anchors = torch.tensor([[6, 15]])
    base = head(ctx, ids, anchors)
    after = ctx.clone()
    after[:, 6:] += torch.randn_like(after[:, 6:])  # the anchor's own position and later
    out = head(ctx=after, input_ids=ids, anchors=anchors)
    tol = _tol(llama, head, 24 + 2 * 4)  # the context and both blocks
    assert_close(out[:, 0], base[:, 0], **tol)  # block 0 (anchor 6) never sees u >= 6
    assert not torch.allclose(out[:, 1], base[:, 1], atol=0.1)  # block 1 (anchor 15) does see 6..14
    before = ctx.clone()
    before[:, 5] += 1.0  # the last context position before anchor 6
    assert not torch.allclose(head(before, ids, anchors)[:, 0], base[:, 0], atol=0.1)
    # other blocks do not leak in: dropping block 1, or changing its anchor token, leaves block 0 alone
    assert_close(head(ctx, ids, anchors[:, :1])[:, 0], base[:, 0], **tol)
    ids2 = ids.clone()
    ids2[0, 15] = (ids[0, 15] + 1) % 250
    out2 = head(ctx, ids2, anchors)
    assert close(out2[:, 0], base[:, 0], **tol) and not torch.allclose(out2[:, 1], base[:, 1], atol=0.1)


def test_block_is_bidirectional(llama):
    """Non-causal within the block: every position sees the anchor token, and the anchor (k=0) sees the masks."""
    head = _head(llama)
    ids = torch.randint(0, 250, (1, 16))
    ctx = _ctx(llama, head, ids)
    base = head(ctx, ids, torch.tensor([[8]]))
    ids2 = ids.clone()
    ids2[0, 8] = (ids[0, 8] + 1) % 250
    changed = head(ctx, ids2, torch.tensor([[8]]))
    assert all(not torch.allclose(changed[0, 0, k], base[0, 0, k], atol=1e-2) for k in range(4))
    head.mask_token_id = 5  # the mask embedding reaches position 0 (the anchor) too
    assert not torch.allclose(head(ctx, ids, torch.tensor([[8]]))[0, 0, 0], base[0, 0, 0], atol=1e-2)


@pytest.mark.parametrize("family", FAMILIES)
def test_draft_block_with_incremental_cache_equals_training_call(family):
    t = load_target(f"tiny:{family}")
    head = _head(t, target_layer_ids=[0])
    ids = torch.randint(0, 250, (1, 20))
    ctx = _ctx(t, head, ids)
    anchors = torch.tensor([[0, 9, 13]])
    with torch.no_grad():
        want = head.logits(head(ctx, ids, anchors)[:, :, 1:])  # [1, 3, 3, V]
        cache = head.new_cache()
        got0 = head.draft_block(ids[:, 0], 0, cache)  # empty context
        for a, b in [(0, 5), (5, 6), (6, 9)]:  # prefill, then accepted positions appended a few at a time
            head.extend_cache(cache, ctx[:, a:b])
        got9 = head.draft_block(ids[0, 9], 9, cache)
        head.extend_cache(cache, ctx[:, 9:13])
        got13 = head.draft_block(ids[:, 13:14], 13, cache)
    assert got9.shape == (1, 3, 320) and got9.dtype == torch.float32
    tol = _tol(t, head, 20, logits=True)
    for n, got in enumerate([got0, got9, got13]):
        assert_close(got, want[:, n], **tol, msg=lambda m: f"block {n}: {m}")
    cache.crop(9)
    assert len(cache) == 9
    assert_close(head.draft_block(ids[0, 9], 9, cache), want[:, 1], **tol)
    with pytest.raises(ValueError, match="anchor at position"):
        head.draft_block(ids[0, 9], 10, cache)


def test_reduced_vocabulary_selects_target_lm_head_rows(llama):
    vocab = torch.tensor([7, 3, 100, 42])
    head = _head(llama, draft_vocab=vocab)
    assert head.draft_token_ids().tolist() == [3, 7, 42, 100] and head.t2d.sum() == 4  # ascending, as EAGLE-3
    assert head.head_config()["vocab_size"] == 4
    full = _head(llama)
    full.load_state_dict({k: v for k, v in head.state_dict().items() if k not in ("d2t", "t2d")})
    h = torch.randn(2, 3, 64)
    rows = llama.model.get_output_embeddings().weight[[3, 7, 42, 100]]
    # norm and 4 rows' GEMM against all 320 rows'
    assert_close(head.logits(h), full.logits(h)[..., [3, 7, 42, 100]], k=64, ops=2, scale=terms(full.norm(h), rows))
    assert head.to_target_ids(torch.tensor([[2, 0]])).tolist() == [[42, 3]]
    assert full.draft_token_ids() is None and torch.equal(full.to_target_ids(torch.tensor([5])), torch.tensor([5]))


@pytest.mark.parametrize("kind", ["folder", "file.pt", "file.safetensors"])
def test_save_load_round_trip(tmp_path, llama, kind):
    head = _head(llama, draft_vocab=torch.arange(40, 80))
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.01 * torch.randn_like(p))  # not the init: norms away from ones
    rec = head_record(head, llama.identity)
    path = save_head(head, tmp_path / "h", rec) if kind == "folder" else save_single_file(head, tmp_path / kind, rec)
    loaded = load_head(str(path), llama, expected_type="dflash")
    sa, sb = head.state_dict(), loaded.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert loaded.head_config() == head.head_config() and loaded.embed_tokens is llama.model.get_input_embeddings()
    ids = torch.randint(0, 250, (1, 12))
    ctx = _ctx(llama, head, ids)
    anchors = torch.tensor([[2, 7]])
    as_loaded(head, llama)  # the same head on the same kernels (tests/same_kernels.py)
    with torch.no_grad():
        assert torch.equal(loaded.logits(loaded(ctx, ids, anchors)), head.logits(head(ctx, ids, anchors)))


def test_checkpoint_with_wrong_shapes_is_refused(tmp_path, llama):
    head = _head(llama)
    path = save_head(head, tmp_path / "h", head_record(head, llama.identity))
    rec = signed(head_record(head, llama.identity), head.state_dict())  # the weights saved, as save_head signs them
    rec["head"]["target_layer_ids"] = [0, 1, 2]  # fc would need 3H inputs; the weights have 2H
    (path / "config.json").write_text(__import__("json").dumps(rec))
    with pytest.raises(UserError, match="fc.weight"):
        load_head(str(path), llama)
    rec["head"]["target_layer_ids"], rec["head"]["num_layers"] = [0, 2], 3  # a layer with no weights
    (path / "config.json").write_text(__import__("json").dumps(rec))
    with pytest.raises(UserError, match="num_layers=3"):
        load_head(str(path), llama)


def test_bf16_target_forward_backward():
    t = load_target("tiny:qwen2")
    t.model.to(torch.bfloat16).requires_grad_(False)
    head = build_dflash(t.model, block_size=4, num_layers=1, tokenizer=t.tokenizer, draft_vocab=torch.arange(100))
    head.float().train()  # fp32 master weights beside a bf16 target
    ids = torch.randint(0, 250, (2, 16))
    with torch.no_grad():
        states = head.target_states(t.model(ids, output_hidden_states=True).hidden_states)
    assert states.dtype == torch.bfloat16
    hidden = head(head.context(states), ids, torch.tensor([[2, 9], [4, 11]]))
    logits = head.logits(hidden[:, :, 1:])
    assert hidden.dtype == torch.float32 and logits.dtype == torch.float32 and logits.shape == (2, 2, 3, 100)
    logits.logsumexp(-1).mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in head.parameters())
    assert all(p.grad is None for p in t.model.parameters())


class _Tok:
    """What default_mask_token_id reads of a tokenizer, shaped like SmolLM2-135M-Instruct's (49152 tokens, the
    code-data specials 3..16 after <|endoftext|>, <|im_start|>, <|im_end|>)."""

    names = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<reponame>", "<file_sep>", "<filename>",
             "<gh_stars>", "<issue_start>", "<issue_comment>", "<issue_closed>", "<jupyter_start>", "<jupyter_text>",
             "<jupyter_code>", "<jupyter_output>", "<jupyter_script>", "<empty_output>"]
    bos_token_id, eos_token_id, pad_token_id, unk_token_id = 1, 2, 2, 0
    chat_template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    added_tokens_decoder = {i: AddedToken(n, special=True) for i, n in enumerate(names)}

    def __len__(self):
        return 49152


def test_mask_token_choice(llama):
    assert default_mask_token_id(_Tok(), 49152) == 16  # SmolLM2: no spare row -> '<empty_output>'
    assert default_mask_token_id(_Tok(), 49216) == 49152  # a padded embedding: its first spare row
    assert default_mask_token_id(llama.tokenizer, 320) == len(llama.tokenizer) == 261
    assert _head(llama, mask_token_id=7).mask_token_id == 7
    assert build_dflash(llama.model).mask_token_id == 319  # no tokenizer (generic builders): the last row


@pytest.mark.parametrize("kw, match", [
    ({"block_size": 1}, "block_size=1"), ({"block_size": 65}, "block_size=65"),
    ({"block_size": 8.5}, "block_size=8.5"), ({"num_layers": 0}, "num_layers=0"),
    ({"target_layer_ids": [1.5]}, "each must be in"),
    ({"target_layer_ids": [0, 3]}, r"each must be in \[0, 2\]"), ({"target_layer_ids": [-1]}, "each must be in"),
    ({"target_layer_ids": []}, "each must be in"), ({"target_layer_ids": [1, 1]}, "repeat a layer"),
    ({"mask_token_id": 320}, r"outside the target's vocabulary \[0, 320\)"), ({"mask_token_id": -1}, "outside"),
    ({"vocab_size": 100}, "vocab_size=100 needs a draft vocabulary"),
])
def test_bad_configs_are_one_line_errors(llama, kw, match):
    args = {"block_size": 4, "num_layers": 1, "tokenizer": llama.tokenizer, **kw}
    with pytest.raises(UserError, match=match) as e:
        build_dflash(llama.model, **args)
    assert "\n" not in str(e.value)
