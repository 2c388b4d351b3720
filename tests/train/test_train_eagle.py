"""train/eagle.py end to end on tiny targets: outputs, learning, exact resume, two processes, bad input."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from selfspec.train.eagle import main
from selfspec.eval.acceptance import rollout_mask

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
    assert result["heldout"]["tau"] >= 1.0
    from selfspec.heads.eagle import build_eagle
    from selfspec.core.target import load_target

    torch.manual_seed(0)  # the recipe's init with train.seed=0: training must have moved every weight
    fresh = build_eagle(load_target("tiny:llama").model).state_dict()
    trained = _weights(out)
    moved = [k for k in trained if k in fresh and not torch.equal(trained[k], fresh[k]) and fresh[k].numel() > 1]
    assert "fc.weight" in moved and any("mlp" in k for k in moved)


def test_reduced_vocab_head(tmp_path):
    out = tmp_path / "run"
    main(TINY + ["train.max_steps=3", "draft.vocab_size=40", f"output_dir={out}"])
    assert _weights(out)["draft_vocab"].shape == (40,)


@pytest.mark.parametrize("precision", [[], ["train.features_dtype=bfloat16", "train.mixed_precision=bf16"]],
                         ids=["fp32", "bf16"])
def test_resume_continues_exactly(tmp_path, capsys, precision):
    common = TINY + ["train.max_steps=8", "train.save_every=4", "train.batch_size=2", "train.grad_accum=2"] + precision
    full, part = tmp_path / "full", tmp_path / "part"
    main(common + [f"output_dir={full}", "resume=auto"])
    assert "no checkpoint" in capsys.readouterr().out
    # An interrupted run: the same config, stopped after the step-4 checkpoint.
    (part / "checkpoints").mkdir(parents=True)
    os.system(f"cp -r {full}/checkpoints/step_00000004 {part}/checkpoints/")
    main(common + [f"output_dir={part}", "resume=auto"])
    assert "resumed from" in capsys.readouterr().out
    a, b = _weights(full), _weights(part)
    assert all(torch.equal(a[k], b[k]) for k in a)


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


def test_two_processes_end_with_identical_weights(tmp_path):
    """Real `accelerate launch` with two CPU processes (torchrun + gloo)."""
    out = tmp_path / "mp"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "conf/accelerate/cpu_2proc.yaml",
           "--main_process_port", "29533", "train/eagle.py", *TINY, "train.max_steps=4", f"output_dir={out}"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    digests = {line.split()[-1] for line in run.stdout.splitlines() if "head sha256" in line}
    ranks = {line.split()[2] for line in run.stdout.splitlines() if "head sha256" in line}
    assert ranks == {"0", "1"} and len(digests) == 1
    assert (out / "head" / "model.safetensors").exists()


def test_unrolled_loss_with_one_step_is_eagles_loss():
    """ttt.steps=1 through the unrolled path (4-D rollout masks, all T positions) gives EAGLE-1's loss."""
    from selfspec.heads.eagle import build_eagle
    from selfspec.core.target import load_target
    from selfspec.train.common import TrainConfig
    from selfspec.train.eagle import eagle_loss, unrolled_loss
    from selfspec.train.rollout import TTTConfig

    target = load_target("tiny:llama")
    torch.manual_seed(0)
    head = build_eagle(target.model, vocab_size=60, draft_vocab=torch.randperm(256)[:60])
    ids = torch.randint(0, 256, (2, 14))
    attn = torch.ones_like(ids)
    attn[1, 10:] = 0  # a padded row
    batch = {"input_ids": ids, "attention_mask": attn, "loss_mask": (torch.rand(2, 14) > 0.3).long() * attn}
    tc = TrainConfig(noise_std=0.0)
    a, sa = eagle_loss(head, head, target.model, batch, tc)
    b, sb = unrolled_loss(head, head, target.model, batch, tc, TTTConfig(steps=1))
    assert torch.allclose(a, b, atol=1e-5) and abs(sa["acc"] - sb["acc"]) < 1e-6
    c, sc = unrolled_loss(head, head, target.model, batch, tc, TTTConfig(steps=3, decay=0.8))
    assert c > b and {"acc_0", "acc_1", "acc_2"} <= set(sc)


def test_trains_with_a_training_time_test(tmp_path):
    out = tmp_path / "run"
    result = main(TINY + ["train.max_steps=3", "ttt.steps=3", "draft.vocab_size=40", "train.eval_every=3",
                          f"output_dir={out}"])
    assert result["steps"] == 3 and result["heldout"]["tau"] >= 1.0


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
    """TensorBoard's hparams refuse nested values and None (it raised ValueError before tracker_config); wandb
    runs offline. Both must see the run's config as flat dotted keys."""
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
