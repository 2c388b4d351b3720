"""DSpark head (methods/dspark/head.py): DFlash's body plus the Markov and confidence heads. Names and shapes as
speculators / llama.cpp store them, the bias is exactly markov_w2(markov_w1[prev]), the decoding path (block_hidden,
then chain_step slot by slot) equals the training call, save/load, and the one-line refusals."""

import pytest
import torch

from selfspec.core.errors import UserError
from selfspec.target.model import load_target
from selfspec.heads.checkpoint import head_record, load_head, save_head
from selfspec.methods.dspark.head import build_dspark
from same_kernels import as_loaded
from tolerance import assert_close, layers

FAMILIES = ["llama", "qwen2", "gemma3"]
QK_NORMS = 2  # a Qwen3 layer's two reductions beyond tolerance.LAYER_OPS: q_norm, k_norm


@pytest.fixture(scope="module")
def llama():
    return load_target("tiny:llama", tiny={"num_hidden_layers": 4})


def _head(target, **kw):
    torch.manual_seed(0)
    kw.setdefault("target_layer_ids", [0, 2])
    return build_dspark(target.model, block_size=4, num_layers=2, markov_rank=8, tokenizer=target.tokenizer,
                        **kw).eval()


def _ctx(target, head, ids):
    with torch.no_grad():
        return head.context(head.target_states(target.model(ids, output_hidden_states=True).hidden_states))


def test_config_names_and_shapes_are_speculators_and_llamacpp(llama):
    head = _head(llama, draft_vocab=torch.arange(40, 80))
    assert head.head_config() == {
        "type": "dspark", "block_size": 4, "num_layers": 2, "target_layer_ids": [0, 2], "mask_token_id": 261,
        "vocab_size": 40, "markov_rank": 8, "confidence_head": True}
    shapes = {k: tuple(v.shape) for k, v in head.state_dict().items() if not k.startswith(("layers.", "fc", "hidden"))}
    # speculators' MarkovHead / ConfidenceHead names; llama.cpp: markov_w1 {r, n_vocab}, markov_w2 {r, n_vocab_draft},
    # conf_proj {n_embd + r, 1} (ggml's reversed order)
    assert shapes == {"norm.weight": (64,), "d2t": (40,), "t2d": (320,), "markov_head.markov_w1.weight": (320, 8),
                      "markov_head.markov_w2.weight": (40, 8), "confidence_head.proj.weight": (1, 64 + 8),
                      "confidence_head.proj.bias": (1,)}
    bare = _head(llama, confidence_head=False)
    assert bare.confidence_head is None and not any(k.startswith("confidence") for k in bare.state_dict())
    h = torch.randn(3, 64)
    assert bare.block_logits(h, torch.tensor([1, 2, 3]))[1] is None


def test_the_markov_bias_is_the_low_rank_table_row_of_the_previous_token(llama):
    head = _head(llama)
    with torch.no_grad():
        for p in head.markov_head.parameters():
            p.normal_()  # a bias far from its near-zero start
        h = torch.randn(2, 64)
        prev = torch.tensor([5, 200])
        logits, conf = head.block_logits(h, prev)
        w1, w2 = head.markov_head.markov_w1.weight, head.markov_head.markov_w2.weight
        bias = w1[prev] @ w2.T  # [2, V]
        assert_close(logits, head.logits(h) + bias, k=8, ops=1)
        want = head.confidence_head.proj(torch.cat([head.norm(h), w1[prev]], -1))[:, 0]
        assert torch.equal(conf, want)
        other, _ = head.block_logits(h, torch.tensor([6, 200]))
        assert not torch.allclose(other[0], logits[0]) and torch.equal(other[1], logits[1])  # rows see their own prev


@pytest.mark.parametrize("family", FAMILIES)
def test_slot_by_slot_decoding_equals_the_training_call(family):
    """Blocks at 0, 9 and 13 of one sequence: the training call (all blocks, teacher-forced previous tokens) and the
    drafter's path (the DFlash cache grown a few positions at a time, block_hidden, one lm_head pass, chain_step per
    slot with the token before it) give the same logits and confidences."""
    t = load_target(f"tiny:{family}")
    head = _head(t, target_layer_ids=[0])
    ids = torch.randint(0, 250, (1, 20))
    ctx = _ctx(t, head, ids)
    anchors = torch.tensor([[0, 9, 13]])
    prev = ids[0, anchors[0, :, None] + torch.arange(4)]  # [3, S]: the anchor, then the tokens slots 0..S-2 predict
    with torch.no_grad():
        want, want_conf = head.block_logits(head(ctx, ids, anchors)[0], prev)  # [3, S, V], [3, S]
        cache = head.new_cache()
        got = []
        for n, (a, b) in enumerate([(0, 0), (0, 9), (9, 13)]):
            head.extend_cache(cache, ctx[:, a:b])
            hidden = head.block_hidden(ids[:, b], b, cache)[0]  # [S, H]
            base, normed = head.logits(hidden), head.norm(hidden)
            got.append([head.chain_step(base[k:k + 1], normed[k:k + 1], prev[n, k:k + 1]) for k in range(4)])
    tol = layers(t.model.config, len(head.layers), width=head.fc.in_features, positions=20,
                 ops=2 + QK_NORMS * len(head.layers) + 2)
    for n in range(3):
        for k, (logits, conf) in enumerate(got[n]):
            assert logits.shape == (1, 320) and logits.dtype == torch.float32
            assert_close(logits[0], want[n, k], **tol, msg=lambda m: f"block {n} slot {k}: {m}")
            assert_close(conf[0], want_conf[n, k], **tol, msg=lambda m: f"block {n} slot {k} confidence: {m}")


def test_save_load_round_trip(tmp_path, llama):
    head = _head(llama, draft_vocab=torch.arange(40, 80))
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.01 * torch.randn_like(p))
    path = save_head(head, tmp_path / "h", head_record(head, llama.identity))
    loaded = load_head(str(path), llama, expected_type="dspark")
    sa, sb = head.state_dict(), loaded.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert loaded.head_config() == head.head_config() and type(loaded).__name__ == "DSparkHead"
    ids = torch.randint(0, 250, (1, 12))
    ctx, prev = _ctx(llama, head, ids), torch.randint(0, 250, (1, 2, 4))
    as_loaded(head, llama)
    with torch.no_grad():
        a = head.block_logits(head(ctx, ids, torch.tensor([[2, 7]])), prev)
        b = loaded.block_logits(loaded(ctx, ids, torch.tensor([[2, 7]])), prev)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_a_record_without_its_markov_rank_is_refused(tmp_path, llama):
    import json

    from selfspec.heads.checkpoint import signed

    head = _head(llama)
    path = save_head(head, tmp_path / "h", head_record(head, llama.identity))
    rec = signed(head_record(head, llama.identity), head.state_dict())
    rec["head"]["markov_rank"] = None
    (path / "config.json").write_text(json.dumps(rec))
    with pytest.raises(UserError, match="no markov_rank"):
        load_head(str(path), llama)


@pytest.mark.parametrize("kw, match", [
    ({"block_size": 1}, "dspark block_size=1"), ({"block_size": 65}, "block_size=65"),
    ({"block_size": "4"}, "block_size='4'"), ({"markov_rank": 0}, "markov_rank=0"),
    ({"markov_rank": 4097}, "markov_rank=4097"), ({"markov_rank": 2.5}, "markov_rank=2.5"),
    ({"confidence_head": "yes"}, "confidence_head='yes'"), ({"num_layers": 0}, "dspark num_layers=0"),
    ({"target_layer_ids": [0, 3]}, r"dspark target_layer_ids \[0, 3\]"),
    ({"mask_token_id": 320}, "dspark mask_token_id=320"),
])
def test_bad_configs_are_one_line_errors(llama, kw, match):
    args = {"block_size": 4, "num_layers": 1, "markov_rank": 8, "tokenizer": llama.tokenizer, **kw}
    with pytest.raises(UserError, match=match) as e:
        build_dspark(llama.model, **args)
    assert "\n" not in str(e.value)
