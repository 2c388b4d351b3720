"""Resumable training state: head weights, optimizer, scheduler, RNG and data position, written atomically.

A checkpoint is a folder `<output_dir>/checkpoints/step_<N>/` that appears only once complete (written to a
temp folder, then renamed) and is renamed away before it is deleted, so a run killed at any moment leaves every
`step_*` folder complete. Its `position.json` records the run it belongs to (`run`: train.loop.run_identity);
pruning keeps the newest `keep` of THAT run (its earlier launches' included: `same_run`), by step number, and never
touches another run's, nor a folder holding anything save_state did not write there (a user's notes). The head's
record in head.safetensors holds the weights' sha256 (heads/checkpoint.py), checked when the checkpoint is read.
Every process's
RNG states (CPU, and CUDA where present) go to `rng.safetensors` (`cpu_<rank>`, `cuda_<rank>`), the fp16
GradScaler's state (if any) to trainer.pt. Nothing is unpickled on load: safetensors and
`torch.load(weights_only=True)`.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from selfspec.core.atomic import fsync_dir, fsync_tree, save_tensors, save_torch, umask_modes
from selfspec.core.errors import UserError
from selfspec.heads.checkpoint import check_digest, signed

STEP_PREFIX = "step_"
HEAD_WEIGHTS = "head.safetensors"  # a checkpoint's head: weights, and its record in the metadata
RESUME_BEFORE = "delete it to resume from the one before"  # what to do about a damaged checkpoint
CHECKPOINT_FILES = (HEAD_WEIGHTS, "rng.safetensors", "trainer.pt", "position.json")  # all a step folder of ours holds
# What killed saves leave in checkpoints/ (never read; removed by the next save): temp, replaced, pruned folders.
LEFTOVER_PREFIXES = (".tmp-", ".old-", ".trash-")
# Tests only (kill-and-resume): seconds to pause in the middle of writing a checkpoint, so a kill can land there.
TEST_PAUSE_ENV = "SELFSPEC_TEST_SAVE_PAUSE"


def checkpoint_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def save_state(output_dir: str | Path, step: int, head_state: dict[str, torch.Tensor], optimizer_state: dict,
               scheduler_state: dict, position: dict[str, Any], keep: int = 2,
               rng: Optional[dict[str, torch.Tensor]] = None, scaler_state: Optional[dict] = None,
               head_config: Optional[dict] = None, same_run: Optional[Callable[[Any], bool]] = None) -> Path:
    """Write checkpoint `step` atomically and prune all but the newest `keep` of the same run (`same_run(identity)`
    of a checkpoint's recorded run; default: it equals position["run"]), never a folder holding other files.
    rng: every process's RNG states (`cpu_<rank>` / `cuda_<rank>` uint8 tensors); None: this process's CPU state.
    head_config: the head's record (heads/checkpoint.head_record), kept in head.safetensors' metadata as a
    single-file head keeps it, with the weights' sha256, so the checkpoint is also a head that load_head and
    scripts/eval_heads.py read."""
    root = checkpoint_dir(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    for leftover in [p for p in root.iterdir() if p.name.startswith(LEFTOVER_PREFIXES)]:
        shutil.rmtree(leftover, ignore_errors=True)  # only this process writes here (rank 0)
    final = root / f"{STEP_PREFIX}{step:08d}"
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        head_state = {k: v.detach().cpu().contiguous() for k, v in head_state.items()}
        meta = {"format": "pt"}
        if head_config is not None:
            meta["selfspec_config"] = json.dumps(signed(head_config, head_state), default=str)
        save_tensors(head_state, tmp / HEAD_WEIGHTS, metadata=meta)
        if os.environ.get(TEST_PAUSE_ENV):
            time.sleep(float(os.environ[TEST_PAUSE_ENV]))
        rng = rng if rng is not None else {"cpu_0": torch.get_rng_state()}
        save_tensors({k: v.cpu().contiguous() for k, v in rng.items()}, tmp / "rng.safetensors")
        trainer = {"optimizer": optimizer_state, "scheduler": scheduler_state, "torch_rng": rng["cpu_0"]}
        if scaler_state is not None:
            trainer["scaler"] = scaler_state
        save_torch(trainer, tmp / "trainer.pt")
        (tmp / "position.json").write_text(json.dumps({"step": step, **position}))
        umask_modes(tmp)  # readable as the user's umask says, not mkdtemp's and safetensors' private modes
        fsync_tree(tmp)
        if final.exists():  # the same step written twice (the end of a run, a resumed run): swap it in
            _remove(final, then=lambda: os.replace(tmp, final))
        else:
            os.replace(tmp, final)
        fsync_dir(root)  # the rename itself survives a power cut
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    same_run = same_run or (lambda run: run == position.get("run"))
    ours = [p for p in list_checkpoints(output_dir) if same_run(checkpoint_run(p)) and not foreign_entries(p)]
    for old in ours[:-keep] if keep > 0 else []:
        _remove(old)
    return final


def foreign_entries(folder: Path) -> list[str]:
    """What a `step_<N>` folder holds that save_state never writes (a user's notes, a head copied there): pruning
    or replacing the folder would delete it."""
    return sorted(p.name for p in folder.iterdir() if p.name not in CHECKPOINT_FILES)


def _remove(folder: Path, then=None) -> None:
    """Delete a checkpoint without ever leaving a half-deleted `step_*` folder: rename it away, (run `then`,)
    delete the renamed folder."""
    trash = folder.with_name(f"{'.old-' if then else '.trash-'}{folder.name}-{os.getpid()}")
    os.replace(folder, trash)
    if then is not None:
        then()
    shutil.rmtree(trash, ignore_errors=True)


def step_of(folder: Path) -> Optional[int]:
    """The step of a `step_<N>` folder; None for any other name."""
    digits = folder.name[len(STEP_PREFIX):]
    return int(digits) if folder.name.startswith(STEP_PREFIX) and digits.isdigit() else None


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """The `step_<N>` folders of output_dir, oldest first by step NUMBER (not by name)."""
    root = checkpoint_dir(output_dir)
    if not root.exists():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and step_of(p) is not None), key=step_of)


def checkpoint_run(folder: Path) -> Any:
    """The run identity a checkpoint records (None: written before runs had one, or unreadable)."""
    try:
        return json.loads((folder / "position.json").read_text()).get("run")
    except (OSError, ValueError, AttributeError):
        return None


def latest_checkpoint(output_dir: str | Path) -> Optional[Path]:
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


CHECKPOINT_PARTS = (HEAD_WEIGHTS, "trainer.pt", "position.json")


def refuse_head_folder(folder: Path) -> None:
    """A head folder copied in as a checkpoint is named as one (not as foreign files, nor as a corrupt checkpoint)."""
    if not (folder / HEAD_WEIGHTS).exists() and (folder / "config.json").exists():
        raise UserError(f"{folder} holds a head folder (config.json, model.safetensors), not a training checkpoint "
                        f"({', '.join(CHECKPOINT_PARTS)}); move it out of {folder.parent} to resume from the "
                        "checkpoint before, or use it as a head (head=...)")


def load_state(folder: Path, target_identity: Optional[dict] = None) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """(head state dict, trainer state {optimizer, scheduler, torch_rng, rng, scaler?}, position {step, epoch,
    batch, run, ...}). A checkpoint whose position records the `target` it was trained for must match
    `target_identity`. `rng` is {} for checkpoints written before every process's RNG was saved."""
    refuse_head_folder(folder)
    try:
        head_state = load_file(str(folder / HEAD_WEIGHTS))
        # a flipped bit is never trained on (nor given a fresh digest by the next save)
        check_digest(_head_record(folder), head_state, str(folder), HEAD_WEIGHTS, fix=RESUME_BEFORE)
        trainer = torch.load(folder / "trainer.pt", map_location="cpu", weights_only=True)
        rng_file = folder / "rng.safetensors"
        trainer["rng"] = load_file(str(rng_file)) if rng_file.exists() else {}
        position = json.loads((folder / "position.json").read_text())
    except PermissionError as e:  # the checkpoint may be fine: never advise deleting it
        raise UserError(f"cannot read checkpoint {folder}: permission denied ({e.filename}); fix its "
                        "permissions") from e
    except FileNotFoundError as e:  # a part is missing: written by a tool other than save_state, or damaged
        missing = [p for p in CHECKPOINT_PARTS if not (folder / p).exists()] or [Path(e.filename or "a part").name]
        raise UserError(f"checkpoint {folder} is incomplete (no {', '.join(missing)}); delete it to resume from the "
                        "one before") from e
    except (SafetensorError, pickle.UnpicklingError, ValueError, RuntimeError, EOFError, KeyError, TypeError) as e:
        # damaged bytes (ValueError covers bad JSON and UTF-8); MemoryError and other OSErrors pass through as
        # themselves: they say nothing about the checkpoint
        raise UserError(f"checkpoint {folder} is unreadable ({type(e).__name__}); delete it to resume from the one "
                        "before") from e
    if target_identity is not None and "target" in position:
        from selfspec.target.model import check_identity

        check_identity(position["target"], target_identity, what=f"checkpoint {folder}")
    return head_state, trainer, position


def _head_record(folder: Path) -> dict:
    """The head record head.safetensors' metadata holds ({} in checkpoints written without one)."""
    from safetensors import safe_open

    with safe_open(str(folder / HEAD_WEIGHTS), "pt") as f:
        record = json.loads((f.metadata() or {}).get("selfspec_config", "{}"))
    return record if isinstance(record, dict) else {}


def load_head_state(module: torch.nn.Module, head_state: dict[str, torch.Tensor], folder: Path) -> None:
    """Load a checkpoint's head weights into `module`; a checkpoint of another target or head shape is refused
    in one line (it would otherwise fail deep inside torch with a multi-line message)."""
    try:
        module.load_state_dict(head_state)
    except RuntimeError as e:
        raise UserError(f"checkpoint {folder} does not fit this run's head (written for another target or draft "
                        f"config?): {' '.join(str(e).split())[:160]}; use another output_dir or overwrite=true") from e


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict, folder: Path) -> None:
    """Load a checkpoint's optimizer state; one written for other parameters (another target's head of the same
    tensor names, another draft config) is refused in one line, as load_head_state refuses other weights."""
    try:
        optimizer.load_state_dict(state)
    except (ValueError, KeyError, TypeError) as e:  # torch: "... parameter group that doesn't match the size ..."
        raise UserError(f"checkpoint {folder} does not fit this run's head (its optimizer state was written for other "
                        f"parameters: another target or draft config?): {' '.join(str(e).split())[:160]}; use "
                        "another output_dir or overwrite=true") from e
