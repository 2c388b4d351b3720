"""Elastic resume (train/run.py ELASTIC): resume=auto continues a run on a longer schedule or another process count,
says so in one line and records it in run.json; resume=exact refuses any change, as every other key is refused."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from harness.two_ranks import head_digests
from selfspec.methods.eagle.train import main

ROOT = Path(__file__).resolve().parents[2]
TINY = ["target=tiny-llama", "data=tiny", "data.max_conversations=24", "train.eval_every=0", "train.eval_prompts=0",
        "train.log_every=1", "train.save_every=2", "train.keep_last=4", "train.schedule=constant",
        "train.warmup_steps=0"]


def _head(out: Path, step: int) -> dict:
    return load_file(str(out / "checkpoints" / f"step_{step:08d}" / "head.safetensors"))


def test_a_finished_run_is_extended_by_a_longer_schedule(tmp_path, capsys):
    out = tmp_path / "run"
    main(TINY + ["train.max_steps=4", f"output_dir={out}"])
    capsys.readouterr()
    result = main(TINY + ["train.max_steps=6", f"output_dir={out}"])
    said = capsys.readouterr().out
    assert result["steps"] == 6
    assert "continuing the run" in said and "from step 4 with train.max_steps 4 -> 6" in said
    assert f"resumed from {out / 'checkpoints' / 'step_00000004'} at step 4" in said
    record = json.loads((out / "run.json").read_text())
    assert record["identity"]["train.max_steps"] == 6
    assert record["elastic"] == [{"step": 4, "changed": {"train.max_steps": [4, 6]}}]
    # Nothing it learned is lost: under a schedule that does not depend on the total (a constant LR here), the
    # extended run is bit-identical to training 6 steps from the start (weights, Adam moments, RNG, data position).
    step4, step6 = _head(out, 4), _head(out, 6)
    assert any(not torch.equal(step4[k], step6[k]) for k in step4)
    fresh = tmp_path / "fresh"
    main(TINY + ["train.max_steps=6", f"output_dir={fresh}"])
    assert all(torch.equal(_head(fresh, 6)[k], step6[k]) for k in step4)


def test_resume_exact_refuses_the_change_and_auto_history_grows(tmp_path, capsys):
    out = tmp_path / "run"
    main(TINY + ["train.max_steps=2", f"output_dir={out}"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(TINY + ["train.max_steps=4", "resume=exact", f"output_dir={out}"])
    assert e.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "holds another run (train.max_steps=2 there, train.max_steps=4 here)" in line and "resume=auto" in line
    main(TINY + ["train.max_steps=4", f"output_dir={out}"])
    main(TINY + ["train.epochs=0.5", "train.max_steps=null", f"output_dir={out}"])  # the same change by epochs
    history = json.loads((out / "run.json").read_text())["elastic"]
    assert [h["step"] for h in history] == [2, 4]
    assert history[1]["changed"] == {"train.max_steps": [4, None], "train.epochs": [1.0, 0.5]}


def test_a_non_elastic_change_is_still_refused_under_auto(tmp_path, capsys):
    out = tmp_path / "run"
    main(TINY + ["train.max_steps=2", f"output_dir={out}"])
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(TINY + ["train.max_steps=4", "train.lr=1e-3", f"output_dir={out}"])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "(train.lr=0.0003 there, train.lr=0.001 here)" in line  # the key that cannot change, not max_steps


def test_a_run_continues_on_two_processes(tmp_path, capsys, launch2):
    """One process, then a two-process launch continues it (the process count is elastic)."""
    out = tmp_path / "run"
    main(TINY + ["train.max_steps=2", f"output_dir={out}"])
    run = launch2(["methods/eagle/train.py", *TINY, "train.max_steps=4", f"output_dir={out}"], ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    said = next(line for line in run.stdout.splitlines() if "continuing the run" in line)
    assert "from step 2 with" in said and "processes 1 -> 2" in said and "train.max_steps 2 -> 4" in said
    assert len(head_digests(run)) == 1  # both ranks end on the same weights
    assert json.loads((out / "run.json").read_text())["elastic"] == [
        {"step": 2, "changed": {"processes": [1, 2], "train.max_steps": [2, 4]}}]


def _before_the_move(identity: dict) -> dict:
    """An identity as methods/eagle/train.py recorded it before its loss knobs left train.* (issue 51)."""
    return {("train." + k[len("eagle."):] if k.startswith("eagle.") else k): v for k, v in identity.items()}


def test_a_run_recorded_before_the_loss_knobs_moved_continues(tmp_path, capsys):
    """run.json and the checkpoints of a run recorded with train.w_feat ... (now eagle.*) are read through the
    recipe's OLD_KEYS (train/run.py old_keys): the run continues as itself, a changed knob is refused under its new
    name, and the next save records the new names."""
    out = tmp_path / "run"
    main(TINY + ["train.max_steps=2", f"output_dir={out}"])
    run_json, position = out / "run.json", out / "checkpoints" / "step_00000002" / "position.json"
    record, pos = json.loads(run_json.read_text()), json.loads(position.read_text())
    record["identity"], pos["run"] = _before_the_move(record["identity"]), _before_the_move(pos["run"])
    run_json.write_text(json.dumps(record))
    position.write_text(json.dumps(pos))
    assert record["identity"]["train.w_feat"] == 1.0 and "eagle.w_feat" not in record["identity"]
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(TINY + ["train.max_steps=4", "eagle.w_tok=1.0", f"output_dir={out}"])
    assert "(eagle.w_tok=0.1 there, eagle.w_tok=1.0 here)" in capsys.readouterr().err.strip().splitlines()[-1]
    result = main(TINY + ["train.max_steps=4", f"output_dir={out}"])
    said = capsys.readouterr().out
    assert result["steps"] == 4 and "from step 2 with train.max_steps 2 -> 4 (elastic" in said  # nothing else moved
    assert json.loads(run_json.read_text())["identity"]["eagle.w_feat"] == 1.0


def test_a_run_recorded_before_the_fingerprint_changed_continues(tmp_path, capsys):
    """run.json and a checkpoint recording the target's fingerprint as selfspec computed it before issue 63 (the bf16
    probe) continue as this run (target/model.py same_fingerprint; another target's is refused: tests/core)."""
    from fingerprints import fingerprint_before_issue_63
    from selfspec.target.model import load_target

    out = tmp_path / "run"
    main(TINY + ["train.max_steps=2", f"output_dir={out}"])
    earlier = fingerprint_before_issue_63(load_target("tiny:llama"))
    run_json, position = out / "run.json", out / "checkpoints" / "step_00000002" / "position.json"
    record, pos = json.loads(run_json.read_text()), json.loads(position.read_text())
    assert record["identity"]["target_identity.fingerprint"] != earlier
    record["identity"]["target_identity.fingerprint"] = pos["run"]["target_identity.fingerprint"] = earlier
    pos["target"]["fingerprint"] = earlier
    run_json.write_text(json.dumps(record))
    position.write_text(json.dumps(pos))
    capsys.readouterr()
    result = main(TINY + ["train.max_steps=4", f"output_dir={out}"])
    said = capsys.readouterr().out
    assert result["steps"] == 4 and "from step 2 with train.max_steps 2 -> 4 (elastic" in said  # nothing else moved


@pytest.mark.parametrize("recipe", ["methods/eagle/train.py", "methods/eagle3/train.py", "methods/layerskip/train.py",
                                    "methods/dflash/train.py", "methods/peagle/train.py"])
def test_renamed_names_keys_each_recipe_has(recipe, capsys):
    """A recipe's OLD_KEYS map every old key to a key of its composed config (or drop it), never to a stale one."""
    import importlib

    import yaml

    from selfspec.core.cli import flatten
    from selfspec.train.run import old_keys, renamed

    importlib.import_module("selfspec." + recipe.removesuffix(".py").replace("/", ".")).main(argv=["--cfg"])
    keys = set(flatten(yaml.safe_load(capsys.readouterr().out)))
    moved = old_keys(recipe)
    assert moved  # each of these recipes was recorded before issue 51 moved the loss knobs
    assert not set(moved) & keys and {new for new in moved.values() if new} <= keys
    old = {"recipe": recipe, "train.lr": 0.1, **{k: 0 for k in moved}}
    assert renamed(old) == {"recipe": recipe, "train.lr": 0.1, **{new: 0 for new in moved.values() if new}}
    assert renamed(renamed(old)) == renamed(old) and renamed(None) is None


def test_keep_last_prunes_the_earlier_launchs_checkpoints_after_an_elastic_resume(tmp_path):
    """The earlier launch's checkpoints are the same run's (its identity differs only in ELASTIC keys): train.keep_last
    counts them, so a run extended by elastic resume keeps the newest keep_last checkpoints, not every old one."""
    out = tmp_path / "run"
    main(TINY + ["train.max_steps=2", "train.save_every=1", "train.keep_last=1", f"output_dir={out}"])
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000002"]
    main(TINY + ["train.max_steps=4", "train.save_every=1", "train.keep_last=1", f"output_dir={out}"])
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000004"]
