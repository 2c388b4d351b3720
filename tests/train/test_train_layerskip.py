"""methods/layerskip/train.py end to end on a 4-layer tiny target: a self-describing head whose trained weights moved,
exact resume, refusal of another exit's checkpoint, offline features, and the one-pass held-out eval."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from selfspec.methods.layerskip.train import main

TINY = ["target=tiny-llama", "+target.tiny.num_hidden_layers=4", "data=tiny", "draft.exit_layer=2",
        "train.eval_every=0", "train.log_every=1", "train.eval_prompts=0"]



def _weights(folder):
    return load_file(str(folder / "head" / "model.safetensors"))


@pytest.mark.parametrize("adapter,moved", [("light", "adapter.up.weight"),
                                           ("layer", "model.layers.0.mlp.up_proj.weight"),
                                           ("lora", "lora_B.model_layers_1_self_attn_q_proj.weight")])
def test_trains_and_writes_a_self_describing_head(tmp_path, adapter, moved):
    out = tmp_path / "run"
    result = main(TINY + [f"draft.adapter={adapter}", "train.max_steps=6", "train.lr=3e-3", "train.eval_prompts=2",
                          "train.eval_new_tokens=16", f"output_dir={out}"])
    cfg = json.loads((out / "head" / "config.json").read_text())
    assert cfg["head"]["type"] == "layerskip" and cfg["head"]["exit_layer"] == 2 and cfg["head"]["adapter"] == adapter
    assert cfg["target"]["num_hidden_layers"] == 4 and "tau" in cfg["metrics"] and "top1" in cfg["metrics"]
    assert 1.0 <= result["heldout"]["tau"] <= 6.0 and (out / "ckpt.pt").exists()
    from selfspec.methods.layerskip.head import build_layerskip
    from selfspec.target.model import load_target

    torch.manual_seed(0)  # the recipe's init with train.seed=0
    fresh = build_layerskip(load_target("tiny:llama", tiny={"num_hidden_layers": 4}).model, exit_layer=2,
                            adapter=adapter, lora_rank=8).state_dict()
    trained = _weights(out)
    assert not torch.equal(trained[moved], fresh[moved])


def test_resume_continues_exactly_and_refuses_another_exit(tmp_path, capsys):
    common = TINY + ["train.max_steps=8", "train.save_every=4", "train.batch_size=2", "draft.vocab_size=40"]
    full, part = tmp_path / "full", tmp_path / "part"
    main(common + [f"output_dir={full}", "resume=auto"])
    (part / "checkpoints").mkdir(parents=True)
    os.system(f"cp -r {full}/checkpoints/step_00000004 {part}/checkpoints/")
    main(common + [f"output_dir={part}", "resume=auto"])
    assert "resumed from" in capsys.readouterr().out
    a, b = _weights(full), _weights(part)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(SystemExit) as e:
        main(common[:-1] + ["draft.exit_layer=3", f"output_dir={part}", "resume=auto"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "exit_layer=2" in err and "exit_layer=3" in err


def test_offline_features(tmp_path):
    from selfspec.scripts.cache_features import main as cache

    feats = tmp_path / "feats"
    cache(["target=tiny-llama", "+target.tiny.num_hidden_layers=4", "data=tiny", "data.max_conversations=20",
           f"data.features_dir={feats}", "extra_layers=[2]"])
    out = tmp_path / "run"
    result = main(TINY + ["train.max_steps=3", "data.features=offline", f"data.features_dir={feats}",
                          f"output_dir={out}"])
    assert result["steps"] == 3 and (out / "head" / "model.safetensors").exists()


def test_eval_counts_chains_of_exact_matches():
    """exit_acceptance on a hand-made path: the exit (an untrained exit at E = L - 1) vs the target's own greedy
    tokens, recomputed directly."""
    from selfspec.methods.layerskip.head import build_layerskip
    from selfspec.target.model import load_target
    from selfspec.eval.acceptance import exit_acceptance, greedy_continuations

    target = load_target("tiny:llama", tiny={"num_hidden_layers": 4})
    head = build_layerskip(target.model, exit_layer=3)
    seqs = greedy_continuations(target, [[{"role": "user", "content": "hello there"}]], 24)
    ev = exit_acceptance(head, target, seqs, 3)
    ids, start = seqs[0]
    with torch.no_grad():
        h = target.model.get_decoder()(input_ids=ids, output_hidden_states=True).hidden_states[3]
        pred = head.logits(head(h))[0].argmax(-1)
    match = [bool(pred[i] == ids[0, i + 1]) for i in range(start - 1, ids.shape[1] - 1)]
    chains = len(match) - 2
    cum = [sum(all(match[i:i + d]) for i in range(chains)) / chains for d in (1, 2, 3)]
    assert ev["chains"] == chains and ev["tau"] == pytest.approx(1 + sum(cum), abs=1e-4)
    assert ev["top1"] == pytest.approx(sum(match) / len(match), abs=1e-4)


@pytest.mark.parametrize("adapter", ["light", "lora"])
def test_bf16_teacher_trains_and_leaves_the_fp32_target_untouched(tmp_path, adapter):
    """train.features_dtype=bfloat16 runs a bf16 COPY of the target as teacher: for LoRA the copy is taken
    before the adapters are injected, so the teacher never sees them."""
    out = tmp_path / "run"
    result = main(TINY + [f"draft.adapter={adapter}", "train.max_steps=3", "train.features_dtype=bfloat16",
                          "train.mixed_precision=bf16", "train.eval_prompts=1", "train.eval_new_tokens=8",
                          f"output_dir={out}"])
    assert result["steps"] == 3 and (out / "head" / "model.safetensors").exists()


@pytest.mark.parametrize("lever", ["eagle.topk=10", "train.topk=10", "train.noise_std=0.2", "train.w_tok=2"])
def test_the_eagle1_lever_is_refused_not_ignored(tmp_path, capsys, lever):
    """Knobs of other recipes' losses are not keys here, and train.w_tok is now layerskip.w_tok (said, issue 63):
    one line."""
    with pytest.raises(SystemExit) as e:
        main(TINY + [lever, f"output_dir={tmp_path}"])
    err = capsys.readouterr().err.strip()
    said = ("config key 'train.w_tok' is now layerskip.w_tok: pass layerskip.w_tok=2" if lever == "train.w_tok=2"
            else f"unknown config key '{lever.split('=')[0]}'")
    assert e.value.code == 2 and "\n" not in err and said in err


@pytest.mark.parametrize("adapter", ["light", "lora"])
def test_a_checkpoint_is_a_head(tmp_path, adapter):
    from selfspec.target.model import load_target
    from selfspec.heads.checkpoint import load_head

    out = tmp_path / "run"
    main(TINY + [f"draft.adapter={adapter}", "train.max_steps=2", "train.save_every=2", f"output_dir={out}"])
    def target():  # one LoRA exit per target: each head on its own copy
        return load_target("tiny:llama", tiny={"num_hidden_layers": 4})

    last = load_head(str(out / "checkpoints" / "step_00000002"), target())
    final = load_head(str(out / "head"), target())
    a, b = last.state_dict(), final.state_dict()
    assert last.head_type == "layerskip" and set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in b)
