"""EAGLE head: shape contract, shared (not copied) target modules, KV-cached stepping, reduced vocabulary."""

import pytest
import torch
from transformers import DynamicCache

from selfspec.methods.eagle.head import build_eagle
from selfspec.target.model import load_target
from selfspec.heads.vocab import top_tokens
from tolerance import assert_close, layers, terms

FAMILIES = ["llama", "qwen2", "gemma3"]


@pytest.mark.parametrize("family", FAMILIES)
def test_stepwise_with_cache_equals_one_pass(family):
    t = load_target(f"tiny:{family}")
    head = build_eagle(t.model).eval()
    ids = torch.randint(0, 250, (1, 20))
    feats = t.model.get_decoder()(input_ids=ids).last_hidden_state
    pos = torch.arange(19)[None]
    full = head(feats[:, :-1], ids[:, 1:], pos)
    cache = DynamicCache()
    parts = [head(feats[:, a:b], ids[:, a + 1:b + 1], pos[:, a:b], past_key_values=cache)
             for a, b in [(0, 7), (7, 8), (8, 19)]]
    # one layer fed by fc [2H -> H], over 19 positions, in three shapes against one
    assert_close(torch.cat(parts, 1), full, **layers(t.model.config, 1, width=head.fc.in_features, positions=19, ops=1))
    assert head.logits(full).shape == (1, 19, t.identity["vocab_size"])


def test_target_modules_are_shared_not_parameters():
    t = load_target("tiny:llama")
    head = build_eagle(t.model)
    keys = set(head.state_dict())
    assert not any("lm_head" in k for k in keys)
    assert head.embed_tokens is t.model.get_input_embeddings()
    assert all(p.data_ptr() != t.model.get_input_embeddings().weight.data_ptr() for p in head.parameters())
    assert "model.layers.0.input_layernorm.weight" not in keys  # EAGLE drops layer 0's input norm
    assert "fc.bias" not in keys  # default serves correctly in vLLM
    assert "fc.bias" in build_eagle(t.model, fc_bias=True).state_dict()


def test_smollm2_sized_head_has_4_2M_parameters():
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
    from selfspec.methods.eagle.head import EagleHead

    n = sum(p.numel() for p in EagleHead(cfg).parameters() if p.requires_grad)
    assert abs(n / 1e6 - 4.2) < 0.05


def test_reduced_vocab_maps_back_to_target_ids():
    t = load_target("tiny:llama")
    seqs = [([5, 6, 6, 7, 7, 7, 9], [1, 1, 1, 1, 1, 1, 0])]  # 9 is not an assistant token
    vocab = top_tokens(seqs, t.identity["vocab_size"], 3)
    assert vocab.tolist() == [7, 6, 5]
    head = build_eagle(t.model, vocab_size=3, draft_vocab=vocab)
    h = torch.randn(1, 4, 64)
    assert head.logits(h).shape == (1, 4, 3)
    full = t.model.get_output_embeddings()(h)[..., vocab]
    rows = t.model.get_output_embeddings().weight[vocab]
    assert_close(head.logits(h), full, k=64, scale=terms(h, rows))  # 3 rows' GEMM against all 320 rows'
    assert head.to_target_ids(torch.tensor([0, 2])).tolist() == [7, 5]
    assert torch.equal(head.state_dict()["draft_vocab"], vocab)


def test_init_from_layer_copies_weights():
    t = load_target("tiny:llama")
    head = build_eagle(t.model, init_from_layer=1)
    src = t.model.get_decoder().layers[1].mlp.up_proj.weight
    assert torch.equal(head.model.layers[0].mlp.up_proj.weight, src)
