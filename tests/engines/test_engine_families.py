"""engines/families.py without an engine: the one-line reasons read from errors and engine logs, the cells built from
engine rows, and the table with its numbered reasons (scripts/check_engine_families.py; `make check-engine-families`
runs the engines)."""

from __future__ import annotations

import pytest

from selfspec.core.errors import first_line
from selfspec.engines.families import cell, cell_text, log_reason, table


def test_first_line_picks_the_error_line_of_a_traceback_or_an_entry_point():
    tb = ("Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
          "NotImplementedError: BPE pre-tokenizer was not recognized - update get_vocab_base_pre()\n"
          "Writing model shards: 100%")
    assert first_line(tb) == "NotImplementedError: BPE pre-tokenizer was not recognized - update get_vocab_base_pre()"
    assert first_line("[train] starting\nerror: target family 'qwen3_next' is not supported") == \
        "target family 'qwen3_next' is not supported"
    assert first_line("") == "no output"
    assert len(first_line("x" * 1000)) == 240 and "\n" not in first_line("a\n\n  b  c ")


def test_log_reason_prefers_the_exception_over_earlier_error_lines(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text("INFO start\nWARNING error handler installed\nRuntimeError: Unsupported CPU attention "
                   "configuration: head_dim=16 isa=2 kv_cache_idx=0\n")
    assert log_reason(log) == "RuntimeError: Unsupported CPU attention configuration: head_dim=16 isa=2 kv_cache_idx=0"
    log.write_text("load_model: failed to load draft model\nmain: exiting\n")
    assert log_reason(log) == "load_model: failed to load draft model"
    log.write_text("0.00.452.187 E llama_init_from_model: failed to initialize the context: dflash requires "
                   "ctx_other to be set (this warning is normal during memory fitting)\n0.00.5 E load: bad header\n"
                   "/work/x/src/llama-graph.cpp:1413: GGML_ASSERT(t != nullptr) failed\n#1 ggml_abort ()\n")
    assert log_reason(log) == "llama-graph.cpp:1413: GGML_ASSERT(t != nullptr) failed"
    log.write_text("0.00.452.187 E llama_init_from_model: failed (this warning is normal)\n0.00.5 E load: bad header\n")
    assert log_reason(log) == "load: bad header"
    log.write_text("all fine\n")
    assert log_reason(log) is None and log_reason(tmp_path / "missing.log") is None


def _row(tokens, drafts=0, drafted=0, accepted=0):
    return {"tokens": tokens, "counters": {"drafts": drafts, "draft_tokens": drafted, "accepted": accepted}}


def test_cells_count_identical_prompts_and_the_engines_counters():
    plain = _row([[1, 2, 3], [4, 5]])
    ok = cell(plain, _row([[1, 2, 3], [4, 5]], 4, 12, 3))
    assert ok == {"loaded": True, "identical": 2, "prompts": 2, "tokens": 5, "drafts": 4, "drafted": 12,
                  "accepted": 3, "output": [[1, 2, 3], [4, 5]]}
    assert cell_text(ok, []) == "ok 2/2 =, 3/12 acc."
    bad = cell(plain, _row([[1, 2, 9], [4, 5]], 4, 12, 0)) | {"divergences": [{"position": 2, "fp32_gap": 0.003}]}
    assert cell_text(bad, []) == "DIFFERS 1/2 = (gap 0.003), 0/12 acc."
    assert cell_text(bad | {"hf_identical": 2}, []) == "DIFFERS 1/2 = (gap 0.003; HF 2/2), 0/12 acc."
    assert cell_text(cell(None, plain) | {"plain": True, "hf_identical": 1}, []) == "ok (HF 1/2)"
    no = cell(None, reason="Traceback ...\nRuntimeError: boom\n")
    assert no == {"loaded": False, "reason": "RuntimeError: boom"}


def test_table_numbers_each_reason_once_and_marks_exporter_refusals():
    results = {
        "llama": {"vllm plain": cell(None, _row([[1]])), "vllm eagle3": cell(None, reason="RuntimeError: boom"),
                  "llamacpp plain": cell(None, _row([[1]])),
                  "llamacpp dflash": cell(_row([[1]]), _row([[1]], 1, 3, 1))},
        "qwen2": {"vllm plain": cell(None, _row([[1]])), "vllm eagle3": cell(None, reason="RuntimeError: boom"),
                  "vllm eagle": cell(None, reason="export refused: format=eagle: Llama layers only")},
    }
    text, reasons = table(results)
    lines = text.splitlines()
    assert lines[0] == ("| family | vLLM plain | vLLM eagle | vLLM eagle3 | vLLM dflash | llama.cpp plain | "
                        "llama.cpp eagle3 | llama.cpp dflash | llama.cpp dspark |")
    assert lines[2] == "| llama | ok | — | no (1) | — | ok | — | ok 1/1 =, 1/3 acc. | — |"
    assert lines[3] == "| qwen2 | ok | refused (2) | no (1) | — | — | — | — | — |"
    assert reasons == ["RuntimeError: boom", "export refused: format=eagle: Llama layers only"]
    same = {f: {"vllm eagle": cell(None, reason=f"export refused: a '{t}' layer")} for f, t in
            (("qwen2", "qwen2"), ("gemma3", "gemma3_text"))}
    text, reasons = table(same, {"qwen2": "qwen2", "gemma3": "gemma3_text"})
    assert reasons == ["export refused: a '<model_type>' layer"] and text.count("refused (1)") == 2


@pytest.mark.llamacpp
def test_the_tiny_qwen2_target_converts_under_the_pre_tokenizer_its_tokenizer_applies(tmp_path):
    """Issue 64: the converter refused the tiny qwen2 target (SmolLM2's vocabulary under Qwen2's regex, the tokenizer
    transformers loads for a qwen2 folder) before llama.cpp ran anything of Qwen2. Named for the converter
    (PRE_TOKENIZERS) it converts; where the converter knows the tokenizer (the llama target's, 'smollm') its own
    name stands whatever is passed."""
    from gguf import GGUFReader
    from transformers import AutoTokenizer

    from llamacpp_converter import require_converter
    from selfspec.core.errors import UserError
    from selfspec.engines.families import PRE_TOKENIZERS, save_target
    from selfspec.engines.llamacpp import convert_target

    src, pydeps = require_converter()
    folders = {f: save_target(f, tmp_path / f, "embedded:smollm2-135m", 32) for f in ("qwen2", "llama")}
    assert {f: PRE_TOKENIZERS.get(type(AutoTokenizer.from_pretrained(d)).__name__) for f, d in folders.items()} == \
        {"qwen2": "qwen2", "llama": None}
    with pytest.raises(UserError, match="BPE pre-tokenizer was not recognized"):
        convert_target(src, str(pydeps), folders["qwen2"], "f32", tmp_path / "refused.gguf")
    assert not (tmp_path / "refused.gguf").exists()
    for family, want in (("qwen2", "qwen2"), ("llama", "smollm")):
        out = convert_target(src, str(pydeps), folders[family], "f32", tmp_path / f"{family}.gguf", "qwen2")
        fields = GGUFReader(str(out)).fields
        assert (fields["general.architecture"].contents(), fields["tokenizer.ggml.pre"].contents()) == \
            (family, want)


def test_a_deeper_tiny_target_keeps_its_familys_layer_pattern(tmp_path):
    """check-engine-families' 8-layer targets (num_layers=8): Qwen3-Next's tiny config names its 2 layers' kinds, and
    8 layers stopped the whole check with transformers' `num_hidden_layers (8) must be equal to the number of
    layer_types (2)`; the pattern now repeats over the layers asked for."""
    import json

    from selfspec.engines.families import save_target

    folder = save_target("qwen3_next", tmp_path / "qwen3_next", None, 32, 8)
    config = json.loads((folder / "config.json").read_text())
    assert config["num_hidden_layers"] == 8 and config["layer_types"] == ["linear_attention", "full_attention"] * 4


def test_a_head_that_did_not_train_says_so_where_the_target_does_not_convert(tmp_path, monkeypatch):
    """Qwen3-Next: llama.cpp's converter refuses the tiny target, and selfspec refuses to train any head on it; each
    head cell gives the head's own reason (the family is refused), the plain cell the converter's."""
    from types import SimpleNamespace

    from selfspec.core.errors import UserError
    from selfspec.engines import llamacpp
    from selfspec.engines.families import llamacpp_cells, save_target

    converter = "convert_hf_to_gguf.py (f32) failed: ['AssertionError']"

    def refuse(*a, **k):
        raise UserError(converter)

    monkeypatch.setattr(llamacpp, "convert_target", refuse)
    folder = save_target("llama", tmp_path / "llama", None)
    cfg = SimpleNamespace(llamacpp_src=str(tmp_path), llamacpp_pythonpath="")
    heads = {"eagle3": "training refused: target family 'qwen3_next' is not supported", "dflash": ("record", {})}
    cells = llamacpp_cells(cfg, folder, tmp_path, heads, [], print)
    assert cells == {"llamacpp plain": {"loaded": False, "reason": converter},
                     "llamacpp eagle3": {"loaded": False, "reason": heads["eagle3"]},
                     "llamacpp dflash": {"loaded": False, "reason": converter}}
