"""DSpark exports (methods/dspark/formats.py): speculators (vLLM's dspark method), the z-lab-style DSparkDraftModel
folder llama.cpp's converter reads, llama.cpp GGUF; names, shapes and keys, round trips bit for bit, and the GGUF
byte-identical to llama.cpp's own converter of the same folder.

Where each expected name and number comes from:
- speculators src/speculators/models/dspark/config.py (c05b95b): speculators_model_type "dspark", sample_from_anchor,
  markov_rank, markov_head_type, enable_confidence_head, confidence_head_with_markov; model_definitions.py:
  markov_head.markov_w1 (Embedding [verifier vocab, r]), markov_head.markov_w2 (Linear r -> draft vocab, no bias),
  confidence_head.proj (Linear H + r -> 1).
- llama.cpp 11434 conversion/qwen.py DSparkModel (registered for DSparkDraftModel): writes dflash.sample_from_anchor
  and dflash.has_confidence_head after DFlashModel's keys; gguf-py tensor_mapping.py maps
  model.markov_head.markov_w{1,2} and model.confidence_head.proj onto markov_w{1,2} and conf_proj;
  src/models/dflash.cpp load_arch_tensors: markov_w1 {r, n_vocab}, markov_w2 {r, n_vocab_draft},
  conf_proj {n_embd + r, 1} and its bias {1}.
"""

import json

import gguf
import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf_fixtures import tokenizer_gguf
from head_exports import export_record, export_state, jittered

from selfspec.core.errors import UserError
from selfspec.target.model import load_target
from selfspec.methods.dspark.head import build_dspark
from selfspec.publish.export import GGUF_TYPES, convert, diff_gguf, to_gguf, write_export, write_gguf
from selfspec.publish.importer import import_head

OWN = {"markov_head.markov_w1.weight": "markov_w1.weight", "markov_head.markov_w2.weight": "markov_w2.weight",
       "confidence_head.proj.weight": "conf_proj.weight", "confidence_head.proj.bias": "conf_proj.bias"}


@pytest.fixture(scope="module")
def target():
    return load_target("tiny:qwen3", tiny={"num_hidden_layers": 4})


@pytest.fixture(scope="module")
def head(target):
    torch.manual_seed(0)
    h = build_dspark(target.model, block_size=4, num_layers=2, target_layer_ids=[0, 2], mask_token_id=7,
                     markov_rank=8)
    return jittered(h)


def test_speculators_layout_is_speculators_dspark(target, head):
    exp = convert(export_record(head, target), export_state(head), target.config, "speculators")
    c = exp.config
    assert c["speculators_model_type"] == "dspark" and c["architectures"] == ["DSparkSpeculator"]
    assert c["sample_from_anchor"] is True and c["markov_rank"] == 8 and c["markov_head_type"] == "vanilla"
    assert c["enable_confidence_head"] is True and c["confidence_head_with_markov"] is True
    assert c["aux_hidden_state_layer_ids"] == [1, 3] and c["block_size"] == 4 and c["mask_token_id"] == 7
    assert c["speculators_config"]["algorithm"] == "dspark"
    assert c["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4  # anchor-first: S per pass
    v = target.identity["vocab_size"]
    assert {k: list(exp.tensors[k].shape) for k in OWN} == {
        "markov_head.markov_w1.weight": [v, 8], "markov_head.markov_w2.weight": [v, 8],
        "confidence_head.proj.weight": [1, 64 + 8], "confidence_head.proj.bias": [1]}


def test_zlab_folder_is_what_llamacpps_converter_reads(target, head):
    exp = convert(export_record(head, target), export_state(head), target.config, "sglang")
    c = exp.config
    assert c["architectures"] == ["DSparkDraftModel"] and c["sample_from_anchor"] is True
    assert c["dflash_config"] == {"target_layer_ids": [0, 2], "mask_token_id": 7, "block_size": 4}
    assert set(exp.tensors) == set(export_state(head))


def test_reduced_vocabulary_is_refused_in_one_line(target):
    torch.manual_seed(0)
    h = build_dspark(target.model, block_size=4, num_layers=1, markov_rank=4, draft_vocab=torch.arange(50))
    for fmt in ("speculators", "sglang"):
        with pytest.raises(UserError, match="reduced vocabulary") as e:
            convert(export_record(h, target), export_state(h), target.config, fmt)
        assert "\n" not in str(e.value)


def _gguf(tmp_path, head, target, outtype="f32"):
    tmp_path.mkdir(exist_ok=True)
    tok = tokenizer_gguf(tmp_path / "target.gguf", target.identity["vocab_size"], "qwen3")
    rec = export_record(head, target)
    return write_gguf(to_gguf(rec, export_state(head), target.config, outtype), rec, tmp_path / "head.gguf", tok)


def test_gguf_holds_the_two_heads_and_the_dspark_keys(tmp_path, target, head):
    r = GGUFReader(str(_gguf(tmp_path, head, target)))
    shapes = {t.name: [int(n) for n in t.shape][::-1] for t in r.tensors}  # back to torch's [out, in]
    v = target.identity["vocab_size"]
    assert {OWN[k]: shapes[OWN[k]] for k in OWN} == {"markov_w1.weight": [v, 8], "markov_w2.weight": [v, 8],
                                                     "conf_proj.weight": [1, 72], "conf_proj.bias": [1]}
    f = r.fields
    assert f["general.architecture"].contents() == "dflash"
    assert f["dflash.sample_from_anchor"].contents() is True and f["dflash.has_confidence_head"].contents() is True
    assert f["dflash.block_size"].contents() == 4 and f["dflash.target_layers"].contents() == [1, 3]
    state = export_state(head)
    for key, name in OWN.items():
        t = next(t for t in r.tensors if t.name == name)
        assert np.array_equal(np.asarray(t.data).reshape(state[key].shape), state[key].numpy()), name
    names = [t.name for t in r.tensors]  # the converter's order: the export's keys sorted ("confidence" < "fc")
    assert names[:3] == ["conf_proj.bias", "conf_proj.weight", "fc.weight"]
    assert names[-3:] == ["markov_w1.weight", "markov_w2.weight", "output_norm.weight"]


@pytest.mark.parametrize("fmt", ["speculators", "sglang"])
def test_export_then_import_is_bit_identical(tmp_path, target, head, fmt):
    rec, state = export_record(head, target), export_state(head)
    out = write_export(convert(rec, state, target.config, fmt), rec, tmp_path / fmt)
    for folder in (out, tmp_path / "bare"):  # our own export, and the same folder as another trainer's
        if folder.name == "bare":
            folder.mkdir()
            for name in ("config.json", "model.safetensors"):
                (folder / name).write_bytes((out / name).read_bytes())
        record, got = import_head(folder, target)
        assert record["head"] == head.head_config()
        assert set(got) == set(state) and all(torch.equal(got[k], state[k]) for k in state)
        assert record["imported_from"]["layout"] == ("selfspec-export" if folder == out else
                                                     {"speculators": "speculators", "sglang": "dspark"}[fmt])


@pytest.mark.parametrize("key, value, match", [
    ("markov_head_type", "gated", "markov_head_type 'gated'"),
    ("sample_from_anchor", False, "sample_from_anchor=false"),
    ("confidence_head_with_markov", False, "hidden state alone"),
])
def test_import_refusals_are_one_line(tmp_path, target, head, key, value, match):
    rec, state = export_record(head, target), export_state(head)
    out = write_export(convert(rec, state, target.config, "speculators"), rec, tmp_path / "spec")
    (out / "selfspec.json").unlink(missing_ok=True)
    cfg = json.loads((out / "config.json").read_text())
    cfg[key] = value
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=match) as e:
        import_head(out, target)
    assert "\n" not in str(e.value)


COMPARED = [("qwen3", t) for t in GGUF_TYPES] + [("llama", "f32"), ("no_confidence", "f32")]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Each compared (case, outtype) through `convert_hf_to_gguf.py <sglang export> --target-model-dir <target>`."""
    from head_exports import rope_cases
    from llamacpp_converter import convert_heads

    def build(target, confidence=True):
        return jittered(build_dspark(target.model, block_size=4, num_layers=2, target_layer_ids=[0, 2],
                                     mask_token_id=7, markov_rank=8, confidence_head=confidence))

    cases = rope_cases({"qwen3": ("qwen3", {}), "llama": ("llama", {}), "no_confidence": ("qwen3", {}, False)}, build)
    return cases, convert_heads(cases, COMPARED, tmp_path_factory, "sglang", weights=True)


@pytest.mark.llamacpp
@pytest.mark.parametrize("case,outtype", COMPARED)
def test_gguf_is_byte_identical_to_llamacpp_converter(tmp_path, converted, case, outtype):
    from llamacpp_converter import named_like

    cases, files = converted
    target, head, record, state = cases[case]
    ref = files[case, outtype]
    exp = to_gguf(record, state, target.config, outtype)
    assert diff_gguf(ref, write_gguf(exp, record, tmp_path / "ours.gguf", ref)) == []
    assert write_gguf(named_like(exp, ref), record, tmp_path / "named.gguf", ref).read_bytes() == ref.read_bytes()
    if case == "no_confidence":
        assert GGUFReader(str(ref)).fields["dflash.has_confidence_head"].contents() is False


def test_gguf_types_keep_1d_tensors_f32_and_fall_back_to_f16_as_the_converter(tmp_path, target, head):
    """1-D tensors stay F32; a row that does not divide into q8_0's blocks of 32 (Markov rank 8, a confidence row
    of 64 + 8) is F16, as conversion/base.py falls back on gguf.QuantError."""
    T = gguf.GGMLQuantizationType
    for outtype, qt in (("bf16", T.BF16), ("q8_0", T.Q8_0)):
        r = GGUFReader(str(_gguf(tmp_path / outtype, head, target, outtype)))
        for t in r.tensors:
            want = T.F32 if len(t.shape) == 1 else T.F16 if qt == T.Q8_0 and int(t.shape[0]) % 32 else qt
            assert t.tensor_type == want, t.name
        if outtype == "q8_0":
            assert {t.name for t in r.tensors if t.tensor_type == T.F16} == {
                "markov_w1.weight", "markov_w2.weight", "conf_proj.weight"}


def test_model_card_describes_the_two_heads(target, head):
    from selfspec.publish.card import model_card

    rec, state = export_record(head, target), export_state(head)
    card = model_card(rec, "me/dspark", state)
    assert "A DSpark semi-autoregressive block draft head for `tiny:qwen3`" in card
    assert "markov_w2(markov_w1[previous token])" in card and "rank 8" in card
    assert "4 tokens per pass" in card and "each slot's chance of acceptance" in card
