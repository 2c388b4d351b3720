"""EAGLE-3 head: aux layers, the 2H-wide layer's residual structure, KV-cached stepping, d2t/t2d mapping."""

import pytest
import torch
from transformers import DynamicCache

from selfspec.heads.checkpoint import head_record, load_head, save_head, save_single_file
from selfspec.methods.eagle3.head import Eagle3Head, build_eagle3, default_aux_layers
from selfspec.target.model import load_target
from selfspec.heads.vocab import top_tokens, vocab_maps
from tolerance import assert_close, layers

FAMILIES = ["llama", "qwen2", "gemma3"]


@pytest.fixture(scope="module")
def llama():
    return load_target("tiny:llama", tiny={"num_hidden_layers": 4})


def _tol(target, head, positions):
    """tests/tolerance.py's k and ops for step 0's output: fc [3H -> H] and hidden_norm, then the 2H-wide layer."""
    return layers(target.model.config, 1, width=head.fc.in_features, positions=positions, ops=2)


def _aux(target, ids, head):
    return head.aux_states(target.model.get_decoder()(input_ids=ids, output_hidden_states=True).hidden_states)


@pytest.mark.parametrize("family", FAMILIES)
def test_stepwise_with_cache_equals_one_pass(family):
    t = load_target(f"tiny:{family}")
    torch.manual_seed(0)
    head = build_eagle3(t.model).eval()
    ids = torch.randint(0, 250, (1, 20))
    aux = _aux(t, ids, head)  # [1, 20, 3H]
    pos = torch.arange(19)[None]
    full = head(aux[:, :-1], ids[:, 1:], pos)
    cache = DynamicCache()
    parts = [head(aux[:, a:b], ids[:, a + 1:b + 1], pos[:, a:b], past_key_values=cache)
             for a, b in [(0, 7), (7, 8), (8, 19)]]
    assert_close(torch.cat(parts, 1), full, **_tol(t, head, 19))
    assert head.logits(full).shape == (1, 19, t.identity["vocab_size"])
    # a later step takes the head's own H-wide output
    nxt = head(full[:, -1:], ids[:, :1], pos[:, -1:] + 1, past_key_values=cache)
    assert nxt.shape == (1, 1, 64) and cache.get_seq_length() == 20


def test_residual_structure_and_own_lm_head(llama):
    """With attention and MLP outputs zeroed the layer passes h through: step 0 returns fc(aux), later steps
    return their input; logits are the head's own lm_head over its own norm, started from the target's rows."""
    torch.manual_seed(0)
    vocab = torch.tensor([7, 3, 100, 42])
    head = build_eagle3(llama.model, draft_vocab=vocab).eval()
    assert torch.equal(head.lm_head.weight, llama.model.get_output_embeddings().weight[[3, 7, 42, 100]])
    assert head.layers[0].self_attn.q_proj.in_features == 128 and head.fc.in_features == 192
    with torch.no_grad():
        head.layers[0].self_attn.o_proj.weight.zero_()
        head.layers[0].mlp.down_proj.weight.zero_()
    ids = torch.randint(0, 250, (2, 6))
    aux = torch.randn(2, 6, 192)
    pos = torch.arange(6)[None].expand(2, -1)
    assert torch.allclose(head(aux, ids, pos), head.fc(aux))
    h = torch.randn(2, 6, 64)
    assert torch.allclose(head(h, ids, pos), h)
    assert torch.allclose(head.logits(h), head.lm_head(head.norm(h)))
    keys = set(head.state_dict())
    assert {"fc.weight", "layers.0.hidden_norm.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= keys
    assert not any("embed" in k for k in keys)  # the target's embedding is shared, not saved


def test_aux_layers_are_pre_norm_residual_streams(llama):
    assert default_aux_layers(30) == [2, 15, 27] and default_aux_layers(4) == [2, 2, 1]
    assert default_aux_layers(2) == [1, 1, 1]
    head = build_eagle3(llama.model, aux_layers=[0, 1, 3])
    ids = torch.randint(0, 250, (1, 5))
    hs = llama.model.get_decoder()(input_ids=ids, output_hidden_states=True).hidden_states
    assert torch.equal(head.aux_states(hs), torch.cat([hs[0], hs[1], hs[3]], -1))
    with pytest.raises(ValueError, match="aux_layers"):
        build_eagle3(llama.model, aux_layers=[1, 2, 4])  # hidden_states[4] is post-norm


def test_d2t_t2d_round_trip(llama):
    seqs = [([9, 5, 5, 200, 200, 200, 7], [1, 1, 1, 1, 1, 1, 0])]  # 7 is not an assistant token
    vocab = top_tokens(seqs, llama.identity["vocab_size"], 3)
    head = build_eagle3(llama.model, draft_vocab=vocab)
    d2t, t2d = head.d2t, head.t2d
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and t2d.shape == (llama.identity["vocab_size"],)
    assert head.draft_token_ids().tolist() == [5, 9, 200]  # ascending target ids
    targets = t2d.nonzero()[:, 0]
    draft = torch.cumsum(t2d.long(), 0)[targets] - 1  # target id -> draft id
    assert torch.equal(head.to_target_ids(draft), targets)  # ... -> target id
    assert head.to_target_ids(torch.tensor([[2, 0]])).tolist() == [[200, 5]]
    with pytest.raises(ValueError):
        vocab_maps(torch.tensor([1, 1]), 10)


@pytest.mark.parametrize("kind", ["folder", "file.pt", "file.safetensors"])
def test_save_load_keeps_weights_and_mapping(tmp_path, llama, kind):
    torch.manual_seed(0)
    head = build_eagle3(llama.model, aux_layers=[1, 2, 3], draft_vocab=torch.arange(40, 80))
    rec = head_record(head, llama.identity)
    assert rec["head"] == {"type": "eagle3", "aux_layers": [1, 2, 3], "vocab_size": 40, "layer": "llama"}
    path = save_head(head, tmp_path / "h", rec) if kind == "folder" else save_single_file(head, tmp_path / kind, rec)
    loaded = load_head(str(path), llama, expected_type="eagle3")
    sa, sb = head.state_dict(), loaded.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert loaded.aux_layers == [1, 2, 3] and loaded.embed_tokens is llama.model.get_input_embeddings()


def test_smollm2_sized_head_parameters():
    """Documents the size: SmolLM2-135M target, 8192-token draft vocabulary -> ~9.8M parameters (4.7M of them
    lm_head)."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
    d2t, t2d = vocab_maps(torch.arange(8192), 49152)
    n = sum(p.numel() for p in Eagle3Head(cfg, default_aux_layers(30), d2t, t2d).parameters())
    assert abs(n / 1e6 - 9.81) < 0.01


def test_documented_decoding_protocol_matches_one_pass(llama):
    """The module docstring's recipe: prefill, draft 3, crop the drafts, step 0 on the accepted positions
    only -> the same states as one pass over the committed sequence."""
    torch.manual_seed(0)
    head = build_eagle3(llama.model).eval()
    x = torch.randint(0, 250, (1, 14))
    n, a = 8, 2  # prompt x_0..x_7 + committed x_8; then x_9, x_10 accepted drafts and x_11 the bonus

    def aux(upto):
        return _aux(llama, x[:, :upto], head)

    with torch.no_grad():
        cache = DynamicCache()
        h = head(aux(n), x[:, 1:n + 1], torch.arange(n)[None], past_key_values=cache)[:, -1:]
        for j in (1, 2):  # steps 1, 2 (their drafts are what verification judges)
            d = head.to_target_ids(head.logits(h).argmax(-1))
            h = head(h, d, torch.tensor([[n + j - 1]]), past_key_values=cache)
        cache.crop(-2)
        assert cache.get_seq_length() == n
        h = head(aux(n + a + 1)[:, n:], x[:, n + 1:n + a + 2], torch.arange(n, n + a + 1)[None], past_key_values=cache)
        ref = head(aux(n + a + 1), x[:, 1:n + a + 2], torch.arange(n + a + 1)[None])[:, n:]
    assert_close(h, ref, **_tol(llama, head, n + a + 1))
