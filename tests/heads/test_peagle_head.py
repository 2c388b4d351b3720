"""P-EAGLE head: the training pass's layout, training pass == decoding pass, multi-layer stacks, save/load, a warm
start's keys, and the one-line refusals."""

import pytest
import torch

from selfspec.core.errors import UserError
from selfspec.target.model import load_target
from selfspec.methods.peagle.drafter import PEagleDrafter
from selfspec.heads.checkpoint import head_record, load_head, save_head
from selfspec.methods.eagle3.head import build_eagle3
from selfspec.methods.peagle.head import build_peagle, cod_anchors, parallel_layout, run_parallel
from same_kernels import as_loaded
from tolerance import assert_close, layers


@pytest.fixture(scope="module")
def llama():
    return load_target("tiny:llama", tiny={"num_hidden_layers": 4})


def _head(target, **kw):
    torch.manual_seed(0)
    kw.setdefault("depth", 4)
    head = build_peagle(target.model, tokenizer=target.tokenizer, **kw).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.02 * torch.randn_like(p))  # away from the init: norms off ones, mask_hidden not tiny
    return head


def _tol(target, head, positions):
    """tests/tolerance.py's k and ops for the head's output: fc [3H -> H] and hidden_norm, then its layers."""
    return layers(target.model.config, len(head.layers), width=head.fc.in_features, positions=positions, ops=2)


def _aux(target, head, ids):
    with torch.no_grad():
        return head.aux_states(target.model.get_decoder()(input_ids=ids, output_hidden_states=True).hidden_states)


def test_layout_of_two_anchors_and_three_depths():
    anchors = [torch.tensor([1, 3]), torch.tensor([3])]
    lay = parallel_layout(anchors, torch.tensor([[1, 1, 1, 1, 0]]))
    # tokens: real 0..4, then slot (1, d1), slot (3, d1), slot (3, d2)
    assert lay["sizes"] == [5, 2, 1]
    assert lay["position_ids"].tolist() == [[0, 1, 2, 3, 4, 2, 4, 5]]
    assert lay["masked"].tolist() == [[False] * 5 + [True] * 3]
    m = lay["attention_mask"][0, 0].int().tolist()
    assert m[2] == [1, 1, 1, 0, 0, 0, 0, 0]  # a real row: causal
    assert m[4] == [1, 1, 1, 1, 0, 0, 0, 0]  # the padded key 4 is never attended, not even by itself
    assert m[5] == [1, 1, 0, 0, 0, 1, 0, 0]  # slot (1, 1): reals <= 1 and itself
    assert m[6] == [1, 1, 1, 1, 0, 0, 1, 0]  # slot (3, 1): reals <= 3 and itself, not the other chain's slot
    assert m[7] == [1, 1, 1, 1, 0, 0, 1, 1]  # slot (3, 2): its chain's depth-1 slot too


def test_cod_anchors_are_nested_and_shrink():
    torch.manual_seed(0)
    a = cod_anchors(100, 5, 0.7, 0.2)
    sizes = [len(x) for x in a]
    assert sizes == [70, 49, 35, 25]  # ceil(100 * max(0.7^d, 0.2)): 70, 49, 34.3, 24.01
    for outer, inner in zip(a, a[1:]):
        assert set(inner.tolist()) <= set(outer.tolist())
    assert [len(x) for x in cod_anchors(10, 4, 0.1, 0.3)] == [3, 3, 3]  # the floor holds


@pytest.mark.parametrize("num_layers", [1, 2])
def test_training_pass_equals_the_decoding_pass(llama, num_layers):
    """The pass over all anchors at once (training, held-out eval) gives, at anchor a, the outputs decoding's cached
    pass over [pairs 0..a, K-1 slots] gives: the same positions, masks and inputs."""
    head = _head(llama, num_layers=num_layers)
    ids = torch.randint(0, 250, (1, 14))
    aux = _aux(llama, head, ids)  # [1, 14, 3H]
    n = 13  # pairs (aux_t, x_{t+1}), t = 0..12
    anchors = torch.arange(n)
    with torch.no_grad():
        outs = run_parallel(head, aux[:, :n], ids[:, 1:], torch.ones(1, n, dtype=torch.long), [anchors] * 3)
    drafter = PEagleDrafter(head, 256)
    tol = _tol(llama, head, n + 3 * n)  # the real positions and every anchor's 3 slots
    for a in (0, 5, 12):
        drafter.reset(ids)
        with torch.no_grad():
            drafter.observe(ids[:, :a + 2], aux[:, :a + 1], 0)  # pairs 0..a; x_{a+1} is the bonus token
        want = torch.stack([outs[0][0, a], *[outs[d][0, a] for d in (1, 2, 3)]])  # [K, H]
        assert_close(drafter.drafts, want, **tol)
    # observing in two parts (the cache cropped back past the first pass's slots) gives the same drafts
    drafter.reset(ids)
    with torch.no_grad():
        drafter.observe(ids[:, :7], aux[:, :6], 0)
        drafter.observe(ids[:, :11], aux[:, 6:10], 6)
    want = torch.stack([outs[0][0, 9], *[outs[d][0, 9] for d in (1, 2, 3)]])
    assert_close(drafter.drafts, want, **tol)


def test_a_slot_reads_no_token_and_no_hidden(llama):
    head = _head(llama)
    ids = torch.randint(0, 250, (1, 8))
    aux = _aux(llama, head, ids)[:, :7]
    anchors = [torch.tensor([4])]
    with torch.no_grad():
        a = run_parallel(head, aux, ids[:, 1:], torch.ones(1, 7, dtype=torch.long), anchors)[1]
        lay = parallel_layout(anchors, torch.ones(1, 7, dtype=torch.long))
        hidden = torch.cat([aux, torch.randn(1, 1, aux.shape[2])], 1)  # garbage where the slot is
        other = head(hidden, torch.cat([ids[:, 1:], torch.tensor([[99]])], 1), lay["position_ids"],
                     attention_mask=lay["attention_mask"], masked=lay["masked"])[:, 7:]
    assert_close(a, other, **_tol(llama, head, 8))


def test_layers_after_the_first_are_plain_llama_layers(llama):
    head = _head(llama, num_layers=3)
    keys = set(head.state_dict())
    assert "layers.0.hidden_norm.weight" in keys and "layers.1.hidden_norm.weight" not in keys
    assert head.layers[0].self_attn.q_proj.in_features == 2 * head.config.hidden_size
    assert head.layers[2].self_attn.q_proj.in_features == head.config.hidden_size
    assert head.mask_hidden.shape == (head.fc.in_features,)
    rows = llama.model.get_input_embeddings().weight.shape[0]
    assert head.head_config() == {"type": "peagle", "aux_layers": head.aux_layers, "vocab_size": rows,
                                  "layer": "llama", "num_layers": 3, "depth": 4, "mask_token_id": 261}


def test_save_load_round_trip(tmp_path, llama):
    head = _head(llama, num_layers=2, draft_vocab=torch.arange(30, 90))
    path = save_head(head, tmp_path / "h", head_record(head, llama.identity))
    loaded = load_head(str(path), llama, expected_type="peagle")
    sa, sb = head.state_dict(), loaded.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert loaded.head_config() == head.head_config()
    as_loaded(head, llama)
    ids = torch.randint(0, 250, (1, 9))
    aux = _aux(llama, head, ids)[:, :8]
    with torch.no_grad():
        want = run_parallel(head, aux, ids[:, 1:], torch.ones(1, 8, dtype=torch.long), [torch.arange(8)])
        got = run_parallel(loaded, aux, ids[:, 1:], torch.ones(1, 8, dtype=torch.long), [torch.arange(8)])
    assert all(torch.equal(w, g) for w, g in zip(want, got))


def test_an_eagle3_head_warm_starts_every_key_but_the_new_ones(llama):
    torch.manual_seed(0)
    e3 = build_eagle3(llama.model, vocab_size=40, draft_vocab=torch.arange(40))
    head = build_peagle(llama.model, vocab_size=40, draft_vocab=torch.arange(40), num_layers=2)
    missing, unexpected = head.load_state_dict(e3.state_dict(), strict=False)
    assert unexpected == [] and sorted(missing) == sorted(["mask_hidden", *[k for k in head.state_dict()
                                                                            if k.startswith("layers.1.")]])


@pytest.mark.parametrize("kw, message", [
    ({"depth": 1}, r"depth must be an integer in \[2, 16\]"),
    ({"depth": 17}, r"depth must be an integer in \[2, 16\]"),
    ({"num_layers": 0}, r"num_layers must be an integer in \[1, 8\]"),
    ({"layer": "target"}, "a peagle head is Llama layers"),
    ({"mask_token_id": 100000}, "outside the target's embedding rows"),
])
def test_refusals(llama, kw, message):
    with pytest.raises(UserError, match=message):
        build_peagle(llama.model, **kw)


def test_an_eagle3_head_of_several_layers_needs_llama_layers():
    t = load_target("tiny:qwen3")
    with pytest.raises(UserError, match="needs layer=llama"):
        build_eagle3(t.model, layer="target", num_layers=2)
