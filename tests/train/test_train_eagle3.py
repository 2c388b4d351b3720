"""methods/eagle3/train.py: the TTT unroll (mask, positions, inputs) against decoding, training, resume, fine-tuning,
offline features and two processes, on tiny targets."""

import json
import os
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from selfspec.heads.checkpoint import lineage_seconds, load_head, read_head, trained_seconds
from selfspec.methods.eagle3.head import build_eagle3
from selfspec.target.model import load_target
from selfspec.methods.eagle3.train import main
from selfspec.train.rollout import ttt_mask, ttt_unroll
from recipe_runs import head_weights, resumed_at_step_3
from tau_checks import assert_tau_is_its_chains
from tolerance import assert_close, layers

ROOT = Path(__file__).resolve().parents[2]
TINY = ["target=tiny-llama", "data=tiny", "train.eval_every=0", "train.log_every=1", "ttt.steps=3"]



def test_ttt_mask_matches_hand_computed():
    attn = torch.tensor([[1, 1, 1], [1, 1, 0]])  # second row: position 2 is padding
    m = ttt_mask(attn, 2)[:, 0].int().tolist()
    assert m[0] == [
        # step-0 keys | step-1 keys | step-2 keys
        [1, 0, 0, 1, 0, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 1, 0],
        [1, 1, 1, 0, 0, 1, 0, 0, 1],
    ]
    assert m[1] == [
        [1, 0, 0, 1, 0, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 1, 0],
        [1, 1, 0, 0, 0, 0, 0, 0, 0],  # the padded chain sees the real step-0 keys only
    ]
    assert ttt_mask(attn, 0)[0, 0].int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]


@pytest.mark.kernels  # two kernel paths compared (tests/tolerance.py); make test reruns it capped
def test_ttt_unroll_equals_step_by_step_decoding():
    """Chain t of the batched unroll = decoding: step 0 over (aux_u, x_{u+1}), u <= t, at positions u; then
    step j feeds the head's own output and x_{t+1+j} at position t+j, with the cache of the same chain."""
    target = load_target("tiny:qwen2")
    torch.manual_seed(0)
    head = build_eagle3(target.model).eval()
    ids = torch.randint(0, 250, (2, 12))
    attn = torch.ones_like(ids)
    attn[1, 9:] = 0  # right padding must not change the real chains
    hs = target.model.get_decoder()(input_ids=ids, output_hidden_states=True).hidden_states
    aux = head.aux_states(hs)
    with torch.no_grad():
        unrolled = list(ttt_unroll(head, aux, ids, attn, steps=3))
        # step j's state went through j + 1 passes of fc (or the state fed back), hidden_norm and the layer
        tol = [layers(target.model.config, j + 1, width=head.fc.in_features, positions=12, ops=2 * (j + 1))
               for j in range(3)]
        for b, t in [(0, 0), (0, 4), (0, 8), (1, 5)]:
            cache = DynamicCache()
            h = head(aux[b:b + 1, :t + 1], ids[b:b + 1, 1:t + 2], torch.arange(t + 1)[None],
                     past_key_values=cache)[:, -1:]
            assert_close(h[0, 0], unrolled[0][b, t], **tol[0])
            for j in (1, 2):
                h = head(h, ids[b:b + 1, t + 1 + j:t + 2 + j], torch.tensor([[t + j]]), past_key_values=cache)
                assert_close(h[0, 0], unrolled[j][b, t], **tol[j], msg=lambda m: f"{(b, t, j)}: {m}")


def test_trains_and_writes_a_loadable_head(tmp_path):
    out = tmp_path / "run"
    result = main(TINY + ["train.max_steps=6", "train.lr=3e-3", "train.eval_every=6", "draft.vocab_size=64",
                          "train.eval_prompts=2", "train.eval_new_tokens=16", f"output_dir={out}"])
    cfg = json.loads((out / "head" / "config.json").read_text())
    assert cfg["head"] == {"type": "eagle3", "aux_layers": [1, 1, 1], "vocab_size": 64, "layer": "llama"}
    assert cfg["training"]["steps"] == 6 and "tau" in cfg["metrics"]
    assert_tau_is_its_chains(result["heldout"])
    assert {"acc_0", "acc_2"} <= set(result)
    target = load_target("tiny:llama")
    head = load_head(str(out / "ckpt.pt"), target, expected_type="eagle3")
    assert head.d2t.shape == (64,) and int(head.t2d.sum()) == 64
    torch.manual_seed(0)  # the recipe's init with train.seed=0: training must have moved the weights
    fresh = build_eagle3(target.model, draft_vocab=head.draft_token_ids()).state_dict()
    trained = head_weights(out)
    moved = {k for k in trained if fresh[k].is_floating_point() and not torch.equal(trained[k], fresh[k])}
    assert {"fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.up_proj.weight", "lm_head.weight"} <= moved
    assert torch.equal(trained["d2t"], fresh["d2t"]) and torch.equal(trained["t2d"], fresh["t2d"])


@pytest.mark.parametrize("precision", [[], ["train.features_dtype=bfloat16", "train.mixed_precision=bf16"]],
                         ids=["fp32", "bf16"])
def test_resume_continues_exactly(tmp_path, capsys, precision):
    common = TINY + ["train.max_steps=6", "train.save_every=3", "train.batch_size=2", "draft.vocab_size=64"] + precision
    a, b = resumed_at_step_3(main, common, tmp_path, capsys)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_fine_tune_keeps_the_draft_vocabulary(tmp_path):
    """A fine-tune (and its resume) keeps the start head's d2t/t2d, whatever its own data or vocab_size say."""
    base, tuned = tmp_path / "base", tmp_path / "tuned"
    main(TINY + ["train.max_steps=2", "draft.vocab_size=64", f"output_dir={base}"])
    again = TINY + ["train.max_steps=4", "train.save_every=2", "draft.vocab_size=32", "data.max_conversations=40",
                    f"draft.init_from={base / 'head'}", f"output_dir={tuned}"]
    main(again)
    a, b = head_weights(base), head_weights(tuned)
    assert torch.equal(a["d2t"], b["d2t"]) and torch.equal(a["t2d"], b["t2d"])
    assert not torch.equal(a["fc.weight"], b["fc.weight"])
    # the record counts the training behind the weights: the start head's, then this run's (checkpoints too)
    first, second = (json.loads((d / "head" / "config.json").read_text())["training"] for d in (base, tuned))
    assert "init_train_seconds" not in first and lineage_seconds(first) == trained_seconds(first) > 0
    assert second["init_train_seconds"] == trained_seconds(first)
    assert lineage_seconds(second) == pytest.approx(trained_seconds(first) + trained_seconds(second), abs=0.002)
    step2 = read_head(str(tuned / "checkpoints" / "step_00000002"))[0]["training"]
    assert step2["init_train_seconds"] == trained_seconds(first)
    third = tmp_path / "third"  # a chunk after the checkpoint: the whole lineage
    main(TINY + ["train.max_steps=1", f"draft.init_from={tuned / 'checkpoints' / 'step_00000002'}",
                 f"output_dir={third}"])
    chained = json.loads((third / "head" / "config.json").read_text())["training"]
    assert chained["init_train_seconds"] == pytest.approx(lineage_seconds(step2), abs=0.002)
    assert lineage_seconds(chained) > lineage_seconds(step2) > trained_seconds(first)
    # a fine-tuned head saved before the field: its lineage is unknown, not its own time alone
    assert lineage_seconds({"train_seconds": 3.0, "init_from": "x"}) is None
    assert lineage_seconds({"train_seconds": 3.0, "dflash": {"init_from": "x"}}) is None
    assert lineage_seconds({"train_seconds": 3.0, "init_train_seconds": None}) is None
    # resumed from its step-2 checkpoint: still the same mapping
    for step in (tuned / "checkpoints").iterdir():
        if step.name != "step_00000002":
            os.system(f"rm -r {step}")
    main(again)
    assert torch.equal(head_weights(tuned)["d2t"], a["d2t"])


def test_offline_features(tmp_path, capsys):
    from selfspec.scripts.cache_features import main as cache_main

    feats = tmp_path / "feats"
    cache_main(["target=tiny-llama", "data=tiny", "data.max_conversations=30", f"data.features_dir={feats}",
                "extra_layers=[1]"])
    result = main(TINY + ["data.features=offline", f"data.features_dir={feats}", "train.max_steps=2",
                          "data.max_conversations=30", f"output_dir={tmp_path / 'run'}"])
    assert result["steps"] == 2
    with pytest.raises(SystemExit) as e:  # a cache without the aux layers is refused with a one-line error
        main(TINY + ["data.features=offline", f"data.features_dir={feats}", "draft.aux_layers=[0,1,1]",
                     f"output_dir={tmp_path / 'run2'}"])
    assert e.value.code == 2 and "no layer_0" in capsys.readouterr().err


def test_wrong_draft_type_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(TINY + ["draft=eagle", f"output_dir={tmp_path}"])
    assert e.value.code == 2 and "draft=eagle3" in capsys.readouterr().err


@pytest.mark.parametrize("lever", ["eagle.topk=10", "ttt.on_policy=true", "train.topk=10", "train.w_feat=1"])
def test_eagle1_levers_are_refused_not_ignored(tmp_path, capsys, lever):
    """EAGLE-1's loss knobs (eagle.*, ttt.on_policy; train.* before they moved) are not in this recipe's schema: the
    config refuses them in one line, before anything runs."""
    with pytest.raises(SystemExit) as e:
        main(TINY + [lever, f"output_dir={tmp_path}"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "\n" not in err and f"unknown config key '{lever.split('=')[0]}'" in err
    assert not any(tmp_path.iterdir())  # refused before it wrote anything


def test_a_checkpoint_is_a_head(tmp_path):
    out = tmp_path / "run"
    main(TINY + ["train.max_steps=2", "train.save_every=1", "train.keep_last=3", f"output_dir={out}"])
    target = load_target("tiny:llama")
    mid, final = load_head(str(out / "checkpoints" / "step_00000001"), target), load_head(str(out / "head"), target)
    assert mid.head_type == "eagle3" and mid.record["training"]["steps"] == 1
    assert torch.equal(mid.d2t, final.d2t)
