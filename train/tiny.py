"""Heads trained a few steps on tiny targets, in-process: what tests/train/test_families.py and
scripts/check_engine_families.py train for every family and recipe."""

from __future__ import annotations

import contextlib
import importlib
import io
from pathlib import Path

from accelerate.state import AcceleratorState, GradientState, PartialState

from selfspec.core.errors import UserError, first_line
from selfspec.registry import method
from selfspec.train.run import release_output_dir


# The overrides every recipe takes (each method's own: its registry entry's `tiny`).
TINY_TRAIN_ARGS = ["data=tiny", "data.max_conversations=16", "data.max_length=96", "train.max_steps=2",
                   "train.eval_every=0", "train.eval_prompts=0", "train.log_every=1", "train.warmup_steps=1",
                   "train.lr=3e-3", "train.save_every=0"]


def train_head(folder: Path, recipe: str, out: Path) -> Path:
    """A head of `recipe` trained a few steps in-process on the target folder (raises UserError with the recipe's
    one-line error)."""
    if (out / "head" / "config.json").exists():
        return out / "head"
    module, extra = method(recipe).recipe, method(recipe).tiny or ()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            importlib.import_module(module).main(["target=hf", f"target.name_or_path={folder}", "target.dtype=float32",
                                                  *TINY_TRAIN_ARGS, *extra, f"output_dir={out}"])
    except SystemExit as e:
        raise UserError(f"training refused: {first_line(err.getvalue())}") from e
    finally:  # each recipe starts from a fresh accelerate state (a process singleton) and no output_dir lock
        release_output_dir()
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()
    return out / "head"
