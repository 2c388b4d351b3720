"""methods/layerskip/head.py: the exit is the target's own norm + lm_head on layer E until trained, layer slices compose
to the full model, checkpoints describe their exit and are refused for another exit layer or target, and the
LoRA adapter leaves the target exactly untouched while off."""

from __future__ import annotations

import pytest
import torch

from selfspec.heads.checkpoint import head_record, load_head, save_head
from selfspec.core.errors import UserError
from selfspec.methods.layerskip.head import build_layerskip, check_exit, run_layers
from selfspec.target.model import load_target, lm_logits
from tolerance import assert_close, layers

torch.set_num_threads(1)


def _target(family="llama", layers=4, seed=0):
    return load_target(f"tiny:{family}", seed=seed, tiny={"num_hidden_layers": layers})


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_layer_slices_compose_and_untrained_exit_is_norm_lm_head(family):
    target = _target(family)
    model = target.model
    ids = torch.randint(0, 250, (1, 24), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(24)[None]
    out = model.get_decoder()(input_ids=ids, output_hidden_states=True)
    h2 = run_layers(model, model.get_input_embeddings()(ids), 0, 2, pos)
    cfg = model.config
    assert_close(h2, out.hidden_states[2], **layers(cfg, 2, positions=24))  # HF hidden_states[E]: after E layers
    top = model.get_decoder().norm(run_layers(model, h2, 2, 4, pos))
    assert_close(top, out.last_hidden_state, **layers(cfg, 4, positions=24, ops=1))  # and the final norm
    head = build_layerskip(model, exit_layer=2, adapter="light", rank=8)
    want = lm_logits(model, model.get_decoder().norm(out.hidden_states[2]))
    assert_close(head.logits(head(head.prefix(ids, pos))), want, **layers(cfg, 2, positions=24, ops=2))


def test_checkpoint_describes_its_exit_and_is_refused_elsewhere(tmp_path):
    target = _target()
    head = build_layerskip(target.model, exit_layer=2, adapter="light", rank=8, vocab_size=40,
                           draft_vocab=torch.arange(40) + 10)
    with torch.no_grad():
        head.adapter.up.weight.normal_()
    save_head(head, tmp_path / "h", head_record(head, target.identity))
    back = load_head(str(tmp_path / "h"), target)
    assert back.head_config() == head.head_config() and back.head_config()["exit_layer"] == 2
    assert torch.equal(back.adapter.up.weight, head.adapter.up.weight)
    assert torch.equal(back.draft_vocab, head.draft_vocab)
    with pytest.raises(UserError, match="exits at layer 2, not at the requested exit_layer=3") as e:
        check_exit(back.head_config(), exit_layer=3)
    assert "\n" not in str(e.value)
    from selfspec.decode.drafters import build_drafter

    with pytest.raises(UserError, match="exit_layer=3"):
        build_drafter("layerskip", target, head=str(tmp_path / "h"), exit_layer=3)
    other = _target(layers=6)
    with pytest.raises(UserError, match="num_hidden_layers") as e:
        load_head(str(tmp_path / "h"), other)
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="outside the target's layers"):
        build_layerskip(target.model, exit_layer=5)


def test_lora_is_off_except_while_drafting():
    target = _target()
    model = target.model
    ids = torch.randint(0, 250, (1, 12), generator=torch.Generator().manual_seed(1))
    before = model(ids).logits
    head = build_layerskip(model, exit_layer=2, adapter="lora", lora_rank=4)
    assert set(head.state_dict()) and all(k.startswith(("lora_A.", "lora_B.")) for k in head.state_dict())
    assert {k.split(".")[1] for k in head.state_dict()} == {f"model_layers_{i}_self_attn_{p}"
                                                             for i in range(2) for p in ("q_proj", "v_proj")}
    with torch.no_grad():
        for p in head.lora_B.parameters():
            p.normal_()
    assert torch.equal(model(ids).logits, before)  # off: the target exactly
    pos = torch.arange(12)[None]
    with head.drafting():
        on = head.prefix(ids, pos)
    plain = model.get_decoder()(input_ids=ids, output_hidden_states=True).hidden_states[2]
    assert not torch.allclose(on, plain)
    assert torch.equal(model(ids).logits, before)
    with pytest.raises(UserError, match="already carries"):
        build_layerskip(model, exit_layer=2, adapter="lora")
