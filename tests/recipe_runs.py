"""Shared by the training recipe tests (tests/train/): a run's head weights, a run resumed from its step-3
checkpoint, and a refusal that writes nothing."""

import os
from pathlib import Path

import pytest
from safetensors.torch import load_file


def head_weights(folder: Path) -> dict:
    return load_file(str(folder / "head" / "model.safetensors"))


def resumed_at_step_3(main, common: list[str], tmp_path: Path, capsys) -> tuple[dict, dict]:
    """`common` (saving every 3 steps) run whole, and run again after an interruption past its step-3 checkpoint.
    -> (the whole run's head weights, the resumed run's)."""
    full, part = tmp_path / "full", tmp_path / "part"
    main(common + [f"output_dir={full}"])
    (part / "checkpoints").mkdir(parents=True)  # an interrupted run: stopped after the step-3 checkpoint
    os.system(f"cp -r {full}/checkpoints/step_00000003 {part}/checkpoints/")
    main(common + [f"output_dir={part}"])
    assert "resumed from" in capsys.readouterr().out
    return head_weights(full), head_weights(part)


def assert_refused_in_one_line(main, args: list[str], tmp_path: Path, capsys, message: str) -> None:
    """The recipe on `args` into tmp_path exits 2 with one line of stderr holding `message`, and writes nothing."""
    with pytest.raises(SystemExit) as e:
        main(args + [f"output_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1, err
    assert not any(tmp_path.iterdir())  # refused before it wrote anything
