"""methods/eagle/train.py end to end on tiny targets: outputs, learning, exact resume, two processes, bad input."""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from selfspec.heads.checkpoint import lineage_seconds, trained_seconds
from selfspec.methods.eagle.train import main
from selfspec.eval.acceptance import rollout_mask
from tau_checks import assert_tau_is_its_chains
from tolerance import assert_close, layers

ROOT = Path(__file__).resolve().parents[2]
TINY = ["target=tiny-llama", "data=tiny", "train.eval_every=0", "train.log_every=1"]



def _weights(folder: Path) -> dict:
    return load_file(str(folder / "head" / "model.safetensors"))


def test_trains_and_writes_a_self_describing_head(tmp_path):
    out = tmp_path / "run"
    result = main(TINY + ["train.max_steps=12", "train.lr=3e-3", "train.eval_every=12", f"output_dir={out}"])
    cfg = json.loads((out / "head" / "config.json").read_text())
    assert cfg["head"]["type"] == "eagle" and cfg["target"]["name_or_path"] == "tiny:llama"
    assert cfg["training"]["steps"] == 12 and "tau" in cfg["metrics"]
    assert (out / "ckpt.pt").exists()
    assert_tau_is_its_chains(result["heldout"])
    from selfspec.methods.eagle.head import build_eagle
    from selfspec.target.model import load_target

    torch.manual_seed(0)  # the recipe's init with train.seed=0: training must have moved every weight
    fresh = build_eagle(load_target("tiny:llama").model).state_dict()
    trained = _weights(out)
    moved = [k for k in trained if k in fresh and not torch.equal(trained[k], fresh[k]) and fresh[k].numel() > 1]
    assert "fc.weight" in moved and any("mlp" in k for k in moved)


def test_the_wall_clock_guard_says_where_it_stopped(tmp_path, capsys):
    out = tmp_path / "run"
    main(TINY + ["train.max_steps=40", "train.max_minutes=1e-6", "train.save_every=0", f"output_dir={out}"])
    training = json.loads((out / "head" / "config.json").read_text())["training"]
    assert training["steps"] == 1 and training["stopped_by"] == "train.max_minutes" and training["planned_steps"] == 40
    assert "train.max_minutes=1e-06 reached: stopped at step 1 of 40" in capsys.readouterr().out
    main(TINY + ["train.max_steps=2", "train.max_minutes=60", f"output_dir={tmp_path / 'whole'}"])
    assert "stopped_by" not in json.loads((tmp_path / "whole" / "head" / "config.json").read_text())["training"]


def test_reduced_vocab_head(tmp_path):
    out = tmp_path / "run"
    main(TINY + ["train.max_steps=3", "draft.vocab_size=40", f"output_dir={out}"])
    assert _weights(out)["draft_vocab"].shape == (40,)


@pytest.mark.parametrize("precision", [[], ["train.features_dtype=bfloat16", "train.mixed_precision=bf16"]],
                         ids=["fp32", "bf16"])
def test_resume_continues_exactly(tmp_path, capsys, precision):
    common = TINY + ["train.max_steps=8", "train.save_every=4", "train.batch_size=2", "train.grad_accum=2"] + precision
    full, part = tmp_path / "full", tmp_path / "part"
    first = main(common + [f"output_dir={full}", "resume=auto"])
    assert "no checkpoint" in capsys.readouterr().out
    # the step time after the warm-up steps (check_gpu sizes its runs by it): 3 of the 8 steps are left
    assert 0 < first["steady_step_s"] * 3 < first["train_seconds"]
    # An interrupted run: the same config, stopped after the step-4 checkpoint.
    (part / "checkpoints").mkdir(parents=True)
    os.system(f"cp -r {full}/checkpoints/step_00000004 {part}/checkpoints/")
    result = main(common + [f"output_dir={part}", "resume=auto"])
    assert "resumed from" in capsys.readouterr().out
    assert "steady_step_s" not in result  # 4 steps in this launch: none past the warm-up
    a, b = _weights(full), _weights(part)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the loop time of the launches a checkpoint continues is counted in (curves against training minutes)
    seconds = {p.name: json.loads((p / "position.json").read_text())["train_seconds"]
               for p in (part / "checkpoints").iterdir()}
    assert 0 < seconds["step_00000004"] < seconds["step_00000008"]
    assert result["total_train_seconds"] == pytest.approx(seconds["step_00000008"], abs=0.002)
    assert result["total_train_seconds"] == pytest.approx(seconds["step_00000004"] + result["train_seconds"], abs=0.002)
    # what eval_heads, plot_curve, bench and the card read of the finished head: every launch, not the last one
    training = json.loads((part / "head" / "config.json").read_text())["training"]
    assert trained_seconds(training) == pytest.approx(seconds["step_00000008"], abs=0.002)
    assert trained_seconds(training) > training["train_seconds"] == pytest.approx(result["train_seconds"], abs=0.002)
    assert trained_seconds({"train_seconds": 7.5}) == 7.5 and trained_seconds({}) is None  # a checkpoint; no record


def test_rollout_mask_matches_hand_computed():
    m = rollout_mask(3, 2)[0, 0].int().tolist()
    assert m == [
        # step-0 keys | depth-1 keys | depth-2 keys
        [1, 0, 0, 1, 0, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 1, 0],
        [1, 1, 1, 0, 0, 1, 0, 0, 1],
    ]


def test_unknown_key_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(TINY + ["train.lrr=1", f"output_dir={tmp_path}"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "train.lrr" in err


@pytest.mark.kernels  # two kernel paths compared (tests/tolerance.py); make test reruns it capped
def test_unrolled_loss_with_one_step_is_eagles_loss():
    """ttt.steps=1 through the unrolled path (4-D rollout masks, all T positions) gives EAGLE-1's loss."""
    from selfspec.methods.eagle.head import build_eagle
    from selfspec.target.model import load_target
    from selfspec.methods.eagle.train import EagleLossConfig, EagleTTTConfig, eagle_loss, unrolled_loss

    target = load_target("tiny:llama")
    torch.manual_seed(0)
    head = build_eagle(target.model, vocab_size=60, draft_vocab=torch.randperm(256)[:60])
    ids = torch.randint(0, 256, (2, 14))
    attn = torch.ones_like(ids)
    attn[1, 10:] = 0  # a padded row
    batch = {"input_ids": ids, "attention_mask": attn, "loss_mask": (torch.rand(2, 14) > 0.3).long() * attn}
    lc = EagleLossConfig(noise_std=0.0)
    a, sa = eagle_loss(head, head, target.model, batch, lc)
    b, sb = unrolled_loss(head, head, target.model, batch, lc, EagleTTTConfig(steps=1))
    # fc [2H -> H], the layer over 14 positions (4-D rollout masks or not), norm, lm_head, log-softmax, the mean
    assert_close(a, b, **layers(target.model.config, 1, width=head.fc.in_features, positions=14, ops=5))
    assert abs(sa["acc"] - sb["acc"]) < 1e-6
    c, sc = unrolled_loss(head, head, target.model, batch, lc, EagleTTTConfig(steps=3, decay=0.8))
    assert c > b and {"acc_0", "acc_1", "acc_2"} <= set(sc)


def test_hass_topk_term_and_position_weights_by_hand():
    """eagle_terms' HASS top-k term and its position weights against hand-computed values."""
    from selfspec.methods.eagle.train import eagle_terms

    p = torch.tensor([[[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]])  # [1, 2, 3]
    logits = torch.tensor([[[1.0, 0.0, -1.0], [0.0, 2.0, 0.0]]])
    logq = torch.log_softmax(logits, -1)
    pred, feats, mask = torch.zeros(1, 2, 4), torch.ones(1, 2, 4), torch.ones(1, 2)
    _, ce, _ = eagle_terms(logits, pred, feats, p, mask)
    per_pos = -(p * logq).sum(-1)[0]
    assert torch.allclose(ce, per_pos.mean())
    _, hass, _ = eagle_terms(logits, pred, feats, p, mask, topk=1, w_topk=0.5)
    top1 = torch.stack([-0.5 * logq[0, 0, 0], -0.8 * logq[0, 1, 2]])
    assert torch.allclose(hass, (per_pos + 0.5 * top1).mean())
    _, all_k, _ = eagle_terms(logits, pred, feats, p, mask, topk=3, w_topk=1.0)
    assert torch.allclose(all_k, 2 * ce)
    feat, tok, acc = eagle_terms(logits, pred, feats, p, mask, weight=torch.tensor([[3.0, 1.0]]))
    assert torch.allclose(tok, (3 * per_pos[0] + per_pos[1]) / 4) and acc == 0.5  # acc is never weighted
    assert torch.allclose(feat, eagle_terms(logits, pred, feats, p, mask)[0])  # the same at every position


def test_acceptance_is_the_overlap_of_the_two_distributions():
    from selfspec.train.rollout import acceptance

    p = torch.tensor([[[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]]])
    logits = torch.tensor([[[0.0, 0.0, -1e9], [0.0, 1e9, 0.0]]])  # q = p on the first, disjoint on the second
    assert torch.allclose(acceptance(p, logits), torch.tensor([[1.0, 0.0]]))


def test_on_policy_weights_follow_the_chain():
    """ttt.on_policy reweights the positions (a different loss from the same head), stays finite, and trains."""
    from selfspec.methods.eagle.head import build_eagle
    from selfspec.target.model import load_target
    from selfspec.methods.eagle.train import EagleLossConfig, EagleTTTConfig, unrolled_loss

    target = load_target("tiny:llama")
    torch.manual_seed(0)
    head = build_eagle(target.model)
    ids = torch.randint(0, 256, (2, 12))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    lc = EagleLossConfig(noise_std=0.0)
    plain, _ = unrolled_loss(head, head, target.model, batch, lc, EagleTTTConfig(steps=2))
    weighted, _ = unrolled_loss(head, head, target.model, batch, lc, EagleTTTConfig(steps=2, on_policy=True))
    assert torch.isfinite(weighted) and not torch.allclose(plain, weighted)
    weighted.backward()
    assert all(torch.isfinite(p.grad).all() for p in head.parameters() if p.grad is not None)


def test_trains_with_the_levers(tmp_path):
    out = tmp_path / "run"
    result = main(TINY + ["train.max_steps=2", "ttt.steps=2", "ttt.on_policy=true", "eagle.topk=4",
                          "draft.vocab_size=40", f"output_dir={out}"])
    assert result["steps"] == 2
    record = json.loads((out / "head" / "config.json").read_text())["training"]
    assert record["eagle"]["topk"] == 4 and record["ttt"]["on_policy"] is True and "topk" not in record["train"]


def test_a_checkpoint_is_a_head(tmp_path):
    """Every resumable checkpoint is also a head (its record in head.safetensors' metadata): load_head reads the
    folder, with the step and training seconds a curve against training time needs."""
    from selfspec.target.model import load_target
    from selfspec.heads.checkpoint import load_head

    out = tmp_path / "run"
    main(TINY + ["train.max_steps=4", "train.save_every=2", "train.keep_last=5", "draft.vocab_size=40",
                 f"output_dir={out}"])
    target = load_target("tiny:llama")
    mid = load_head(str(out / "checkpoints" / "step_00000002"), target)
    last = load_head(str(out / "checkpoints" / "step_00000004" / "head.safetensors"), target)
    final = load_head(str(out / "head"), target)
    assert mid.record["training"]["steps"] == 2 and last.record["training"]["steps"] == 4
    assert 0 < mid.record["training"]["train_seconds"] <= last.record["training"]["train_seconds"]
    assert mid.draft_vocab is not None and torch.equal(mid.draft_vocab, final.draft_vocab)
    a, b = last.state_dict(), final.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in b)
    assert any(not torch.equal(mid.state_dict()[k], b[k]) for k in b)


def test_trains_with_a_training_time_test(tmp_path):
    out = tmp_path / "run"
    result = main(TINY + ["train.max_steps=3", "ttt.steps=3", "draft.vocab_size=40", "train.eval_every=3",
                          f"output_dir={out}"])
    assert result["steps"] == 3
    assert_tau_is_its_chains(result["heldout"])


def test_resume_refuses_a_checkpoint_of_another_target(tmp_path, capsys):
    """Resume checkpoints record the target: the same shapes with other weights (another seed) are refused."""
    out = tmp_path / "run"
    main(TINY + ["train.max_steps=2", f"output_dir={out}"])
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(TINY + ["train.max_steps=4", "target.seed=1", f"output_dir={out}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: this checkpoint") and "fingerprint" in err[0]


@pytest.mark.parametrize("logger", ["tensorboard", "wandb"])
def test_trackers_take_the_composed_config(tmp_path, monkeypatch, logger):
    """TensorBoard's hparams refuse nested values and None (it raised ValueError before train/preamble.start
    flattened the config for it); wandb runs offline. Both must see the run's config as flat dotted keys."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.chdir(tmp_path)  # tensorboard writes under the project name, relative to the working directory
    out = tmp_path / "run"
    main(TINY + ["train.max_steps=2", f"logger={logger}", f"output_dir={out}"])
    assert (out / "head" / "model.safetensors").exists()
    if logger == "tensorboard":
        assert list(tmp_path.rglob("events.out.tfevents.*"))
    else:
        assert list(tmp_path.rglob("*.wandb"))


def test_fine_tune_keeps_the_start_heads_shape_and_draft_vocabulary(tmp_path, capsys):
    """draft.init_from: the start head's weights, layers and draft vocabulary, whatever this run's draft.* say; its
    training time counted in the lineage; init_from with init_from_layer refused in one line before any file."""
    base, tuned = tmp_path / "base", tmp_path / "tuned"
    main(TINY + ["train.max_steps=2", "draft.vocab_size=64", f"output_dir={base}"])
    capsys.readouterr()
    main(TINY + ["train.max_steps=2", "draft.vocab_size=32", "draft.num_layers=2", "data.max_conversations=40",
                 f"draft.init_from={base / 'head'}", f"output_dir={tuned}"])
    said = [line for line in capsys.readouterr().out.splitlines() if "ignored" in line]
    assert len(said) == 1 and "draft.num_layers=2, draft.vocab_size=32 ignored" in said[0], said
    a, b = _weights(base), _weights(tuned)
    assert a.keys() == b.keys() and torch.equal(a["draft_vocab"], b["draft_vocab"]) and a["draft_vocab"].numel() == 64
    assert not torch.equal(a["fc.weight"], b["fc.weight"])
    first, second = (json.loads((d / "head" / "config.json").read_text()) for d in (base, tuned))
    assert second["head"] == first["head"] and second["training"]["init_from"] == str(base / "head")
    assert second["training"]["init_train_seconds"] == trained_seconds(first["training"])
    assert lineage_seconds(second["training"]) > trained_seconds(first["training"])
    # the start point is the head's weights: one step at a learning rate of 1e-12 leaves them where they were
    still = tmp_path / "still"
    main(TINY + ["train.max_steps=1", "train.lr=1e-12", f"draft.init_from={base / 'head'}", f"output_dir={still}"])
    assert all(torch.allclose(a[k].float(), v.float(), rtol=0, atol=1e-9) for k, v in _weights(still).items())
    capsys.readouterr()
    both = tmp_path / "both"
    with pytest.raises(SystemExit) as e:
        main(TINY + ["train.max_steps=1", f"draft.init_from={base / 'head'}", "draft.init_from_layer=0",
                     f"output_dir={both}"])
    assert e.value.code == 2 and not both.exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "draft.init_from" in err[0] and "init_from_layer" in err[0]
