"""Importing heads trained elsewhere: each layout written the way its trainer names the tensors, imported, and the
imported head's outputs equal to the original's bit for bit; then the one-line refusals.

Names as the trainers write them (sources read for this test):
- SafeAILab EAGLE eagle/model/cnets1.py `Model`: embed_tokens (the target's, frozen), fc = nn.Linear(2H, H,
  bias=bias), layers = ModuleList(LlamaDecoderLayer(config, index)) with input_layernorm only where index != 0; no
  final norm, no lm_head. accelerate's save_state writes the prepared model's state dict as model.safetensors.
- SpecForge specforge/modeling/draft/llama3_eagle.py `LlamaForCausalLMEagle3`: embed_tokens, midlayer
  (hidden_norm, input_layernorm, self_attn q/k/v over 2H, mlp, post_attention_layernorm), fc [H, 3H], norm,
  lm_head [draft_vocab_size, H], buffers t2d and d2t. SGLang's set_eagle3_layers_to_capture adds 1 to
  eagle_config.eagle_aux_hidden_state_layer_ids (each names a layer's output).
"""

import json

import pytest
import torch
from safetensors.torch import save_file

from selfspec.core.errors import UserError
from selfspec.target.model import load_target
from selfspec.heads.checkpoint import head_record, load_head
from selfspec.methods.eagle.head import build_eagle
from selfspec.methods.eagle3.head import build_eagle3
from selfspec.publish.export import convert, write_export
from selfspec.publish.importer import import_head, imported_head, write_import
from selfspec.scripts import import_head as import_script
from same_kernels import as_loaded


@pytest.fixture(scope="module")
def target():
    return load_target("tiny:llama")


def _outputs(head, target):
    """The head's output features and logits on random inputs [B=1, T=5], on the kernels a loaded head uses."""
    as_loaded(head, target)
    g = torch.Generator().manual_seed(3)
    width = head.fc.in_features if head.head_type == "eagle3" else target.config.hidden_size
    feats = torch.randn(1, 5, width, generator=g)
    ids = torch.randint(0, 256, (1, 5), generator=g)
    with torch.no_grad():
        out = head(feats, ids, torch.arange(5)[None])
        return torch.cat([out.flatten(), head.logits(out).flatten()])


def _config(target, **extra):
    return {**target.config.to_dict(), "architectures": ["LlamaForCausalLM"], **extra}


def _eagle_checkpoint(head, target, folder, store="safetensors", config=True):
    """An EAGLE-1 head as SafeAILab's cnets1.Model names its state dict, with the frozen embedding included."""
    tensors = {k.removeprefix("model."): v.clone() for k, v in head.state_dict().items()
               if k != "model.embed_tokens.weight"}  # selfspec's 1-row stub; cnets1 holds the target's embedding
    tensors["embed_tokens.weight"] = target.model.get_input_embeddings().weight.detach().clone()
    folder.mkdir()
    if store == "bin":
        torch.save(tensors, folder / "pytorch_model.bin")
    else:
        prefix = "module." if store == "accelerate-ddp" else ""  # save_state of a DDP-wrapped model
        save_file({prefix + k: v for k, v in tensors.items()}, str(folder / "model.safetensors"))
    if config:
        cfg = _config(target, num_hidden_layers=head.config.num_hidden_layers)  # num_hidden_layers: the head's
        (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def _specforge_checkpoint(head, target, folder, sglang_ids=None):
    """An EAGLE-3 head as SpecForge's LlamaForCausalLMEagle3 names it (config.json as its draft configs)."""
    tensors = {("midlayer." + k.removeprefix("layers.0.") if k.startswith("layers.0.") else k): v.clone()
               for k, v in head.state_dict().items()}
    tensors["embed_tokens.weight"] = target.model.get_input_embeddings().weight.detach().clone()
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    cfg = _config(target, architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1,
                  draft_vocab_size=int(head.d2t.numel()))
    if sglang_ids is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": sglang_ids}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def _round_trip(tmp_path, target, head, src, **options):
    """Import src, write it, load it back with load_head: both equal the original head's outputs."""
    record, state = import_head(src, target, **options)
    assert record["library"] == "selfspec" and record["target"] == target.identity
    assert record["imported_from"]["path"] == str(src.resolve()) and len(record["imported_from"]["sha256"]) == 64
    imported = imported_head(src, target, **options)
    assert torch.equal(_outputs(imported, target), _outputs(head, target))
    out = write_import(imported, tmp_path / "imported")
    loaded = load_head(str(out), target)
    assert torch.equal(_outputs(loaded, target), _outputs(head, target))
    return record


# ---------------------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("fc_bias,num_layers,store", [(False, 1, "safetensors"), (True, 1, "bin"),
                                                      (True, 2, "safetensors")])
def test_original_eagle_layout_round_trips(tmp_path, target, fc_bias, num_layers, store):
    torch.manual_seed(0)
    head = build_eagle(target.model, num_layers=num_layers, fc_bias=fc_bias)
    src = _eagle_checkpoint(head, target, tmp_path / "eagle", store)
    record = _round_trip(tmp_path, target, head, src)
    assert record["head"] == {"type": "eagle", "num_layers": num_layers, "fc_bias": fc_bias, "vocab_size": None,
                              "layer": "llama"}  # SafeAILab EAGLE's layers are Llama layers
    assert record["imported_from"]["layout"] == "eagle"


def test_accelerate_state_folder_with_a_separate_config(tmp_path, target):
    """save_state writes the wrapped model's keys (`module.`) and no config.json: config= gives it; without it the
    layer count comes from the weights."""
    torch.manual_seed(1)
    head = build_eagle(target.model, fc_bias=True)
    src = _eagle_checkpoint(head, target, tmp_path / "state_19", "accelerate-ddp", config=False)
    (tmp_path / "config.json").write_text(json.dumps(_config(target, num_hidden_layers=1)))
    _round_trip(tmp_path, target, head, src, config=str(tmp_path / "config.json"))
    _, state = import_head(src, target)  # no config: shapes alone
    assert torch.equal(state["fc.bias"], head.fc.bias.detach())


def test_speculators_eagle1_folder_round_trips(tmp_path, target):
    torch.manual_seed(2)
    head = build_eagle(target.model)
    record = head_record(head, target.identity)
    src = write_export(convert(record, head.state_dict(), target.config, "speculators"), record, tmp_path / "spec")
    (src / "selfspec.json").unlink()  # as another tool would have written it
    assert _round_trip(tmp_path, target, head, src)["imported_from"]["layout"] == "speculators"


@pytest.mark.parametrize("vocab_size", [32, None])
def test_speculators_eagle3_folder_round_trips(tmp_path, vocab_size):
    target = load_target("tiny:llama", tiny={"num_hidden_layers": 3})  # 3 distinct layers: vLLM reads each once
    torch.manual_seed(3)
    vocab = torch.randperm(target.identity["vocab_size"])[:vocab_size] if vocab_size else None
    head = build_eagle3(target.model, aux_layers=[0, 1, 2], vocab_size=vocab_size, draft_vocab=vocab)
    record = head_record(head, target.identity)
    src = write_export(convert(record, head.state_dict(), target.config, "speculators"), record, tmp_path / "spec3")
    (src / "selfspec.json").unlink()
    imported = _round_trip(tmp_path, target, head, src)
    assert imported["head"]["aux_layers"] == [0, 1, 2]  # vLLM's ids are HF hidden_states ids: kept as they are


def test_specforge_eagle3_folder_round_trips(tmp_path, target):
    torch.manual_seed(4)
    head = build_eagle3(target.model, aux_layers=[1, 1, 1], vocab_size=32,
                        draft_vocab=torch.randperm(target.identity["vocab_size"])[:32])
    src = _specforge_checkpoint(head, target, tmp_path / "specforge", sglang_ids=[0, 0, 0])
    record = _round_trip(tmp_path, target, head, src)
    assert record["head"]["aux_layers"] == [1, 1, 1]  # SGLang's "output of layer 0" is HF hidden_states[1]
    assert record["imported_from"]["layout"] == "eagle3"


def test_our_sglang_export_imports_as_specforge_with_the_same_layers(tmp_path, target):
    """Export and import agree on SGLang's layer ids: an export without selfspec.json reads back as it was."""
    torch.manual_seed(9)
    head = build_eagle3(target.model, aux_layers=[1, 1, 1], vocab_size=None)
    record = head_record(head, target.identity)
    src = write_export(convert(record, head.state_dict(), target.config, "sglang"), record, tmp_path / "sglang")
    (src / "selfspec.json").unlink()
    config = json.loads((src / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 0, 0]
    assert _round_trip(tmp_path, target, head, src)["head"]["aux_layers"] == [1, 1, 1]


def test_specforge_without_aux_layers_needs_the_option(tmp_path, target):
    torch.manual_seed(5)
    head = build_eagle3(target.model, aux_layers=[1, 1, 1], vocab_size=None)
    src = _specforge_checkpoint(head, target, tmp_path / "specforge")
    with pytest.raises(UserError, match=r"pass aux_layers=.*\[1, 1, 1\]") as e:
        import_head(src, target)
    assert "\n" not in str(e.value)
    _round_trip(tmp_path, target, head, src, aux_layers=[1, 1, 1])


def test_a_selfspec_export_is_read_back_with_its_record(tmp_path, target):
    """With selfspec.json the export's own record says what the tensors are (SGLang's zero fc bias, the token map)."""
    torch.manual_seed(8)
    head = build_eagle(target.model, vocab_size=16, draft_vocab=torch.randperm(target.identity["vocab_size"])[:16])
    record = head_record(head, target.identity, metrics={"tau": 2.5})
    src = write_export(convert(record, head.state_dict(), target.config, "sglang"), record, tmp_path / "sglang")
    imported = _round_trip(tmp_path, target, head, src)
    assert imported["head"] == record["head"] and imported["metrics"] == {"tau": 2.5}
    assert imported["imported_from"]["layout"] == "selfspec-export"


def test_cli_imports_and_the_head_decodes(tmp_path, target, capsys):
    from selfspec.decode.drafters import build_drafter
    from selfspec.decode.engine import generate

    torch.manual_seed(6)
    head = build_eagle(target.model, fc_bias=True)
    src = _eagle_checkpoint(head, target, tmp_path / "eagle")
    out = tmp_path / "head"
    result = import_script.main([f"src={src}", f"out={out}", "target=tiny-llama"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    assert result["head"]["type"] == "eagle" and result["imported_from"]["layout"] == "eagle"
    prompt = torch.arange(10, 30)
    plain = generate(target, None, prompt, 16, eos_token_ids=[])
    drafted = generate(target, build_drafter("eagle", target, head=str(out)), prompt, 16, eos_token_ids=[])
    assert drafted.tokens == plain.tokens  # lossless: the imported head decodes


# ---------------------------------------------------------------------------------------------- refusals


def _refused(match, fn, *args, **kwargs):
    with pytest.raises(UserError, match=match) as e:
        fn(*args, **kwargs)
    assert "\n" not in str(e.value)


@pytest.fixture()
def eagle_src(tmp_path, target):
    torch.manual_seed(7)
    return _eagle_checkpoint(build_eagle(target.model), target, tmp_path / "src")


def test_a_config_for_another_target_is_refused(eagle_src, target):
    cfg = json.loads((eagle_src / "config.json").read_text())
    (eagle_src / "config.json").write_text(json.dumps({**cfg, "hidden_size": 128}))
    _refused("hidden_size=128.*hidden_size=64", import_head, eagle_src, target)
    (eagle_src / "config.json").write_text(json.dumps({**cfg, "vocab_size": 999}))
    _refused("vocab_size=999.*vocab_size=320", import_head, eagle_src, target)


def test_an_embedding_of_another_vocabulary_is_refused(eagle_src, target):
    (eagle_src / "config.json").unlink()
    from safetensors.torch import load_file

    tensors = load_file(str(eagle_src / "model.safetensors"))
    tensors["embed_tokens.weight"] = torch.zeros(999, 64)
    save_file(tensors, str(eagle_src / "model.safetensors"))
    _refused(r"embed_tokens.weight.*\[999, 64\].*\[320, 64\]", import_head, eagle_src, target)


def test_what_the_head_cannot_hold_is_refused(eagle_src, target):
    from safetensors.torch import load_file

    tensors = load_file(str(eagle_src / "model.safetensors"))
    save_file({**tensors, "layers.0.input_layernorm.weight": torch.ones(64)}, str(eagle_src / "model.safetensors"))
    _refused("input_layernorm on layer 0", import_head, eagle_src, target)
    save_file({**tensors, "norm.weight": torch.ones(64)}, str(eagle_src / "model.safetensors"))
    _refused("no place for model.norm.weight", import_head, eagle_src, target)


def test_norm_before_residual_is_refused(tmp_path, target):
    head = build_eagle3(target.model, aux_layers=[1, 1, 1], vocab_size=None)
    src = _specforge_checkpoint(head, target, tmp_path / "sf", sglang_ids=[0, 0, 0])
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "norm_before_residual": True}))
    _refused("norm_before_residual", import_head, src, target)


def test_unknown_layout_missing_weights_and_unknown_tensors(tmp_path, eagle_src, target):
    _refused("unknown layout 'medusa'", import_head, eagle_src, target, fmt="medusa")
    (tmp_path / "empty").mkdir()
    _refused("no weights in .*model.safetensors or pytorch_model.bin", import_head, tmp_path / "empty", target)
    _refused("not found", import_head, tmp_path / "nowhere", target)
    save_file({"medusa_head.0.weight": torch.zeros(2, 2)}, str(tmp_path / "other.safetensors"))
    _refused("cannot tell the layout", import_head, tmp_path / "other.safetensors", target)
    (tmp_path / "junk.bin").write_bytes(b"not a checkpoint")
    _refused("refused|corrupt", import_head, tmp_path / "junk.bin", target, fmt="eagle")


def test_cli_never_overwrites_without_being_asked(tmp_path, eagle_src, capsys):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    argv = [f"src={eagle_src}", f"out={out}", "target=tiny-llama"]
    for extra in ([], ["overwrite=true"]):  # overwrite=true still never replaces a folder that is not a head
        with pytest.raises(SystemExit) as e:
            import_script.main(argv + extra)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith("error: out ") and err.count("\n") == 1
    assert (out / "notes.txt").read_text() == "mine"
    (out / "notes.txt").unlink()
    import_script.main(argv)  # empty: fine
    with pytest.raises(SystemExit):
        import_script.main(argv)  # now a head: refused without overwrite ...
    assert "overwrite=true" in capsys.readouterr().err
    assert import_script.main(argv + ["overwrite=true"])["out"] == str(out)  # ... replaced with it
