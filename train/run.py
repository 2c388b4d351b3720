"""One output_dir holds one run. Its identity (`run_record`: the config that shapes its result) is recorded in every
checkpoint and in `<output_dir>/run.json`, and each launch's composed config in `config.yaml`, both written with
the launch's first checkpoint (a launch stopped by bad input leaves output_dir as it was). `resume_point`
continues only the same run, refuses another one in one line naming the first key that differs, and replaces it
only with `overwrite=true` (its checkpoints removed at the first save). `hold_output_dir` (at the launch's start:
train.preamble.accelerator_for) takes output_dir's writer lock for the run's life, so a second run on the folder is
refused; `release_output_dir` drops it at the end. What a launch would delete that is not selfspec's is refused
before it starts: a file in a `checkpoints/step_<N>/` folder (pruned or replaced), a note added to config.yaml
(rewritten). keep_last counts the checkpoints of the run's earlier launches too (`same_run`: an elastic resume).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from selfspec.core.cli import flatten
from selfspec.core.errors import UserError
from selfspec.target.model import same_fingerprint
from selfspec.train.state import (checkpoint_dir, foreign_entries, list_checkpoints, load_state, refuse_head_folder,
                                  step_of)

RUN_FILE, CONFIG_FILE = "run.json", "config.yaml"  # in output_dir: the run's identity; the last launch's config
# Config keys that do not change what a run computes: where it writes, how it resumes, how often it logs,
# evaluates and saves, its wall-clock budget, caches. A launch with other values of these continues the same run;
# any other key (and every key added later) is part of the run's identity.
NOT_IDENTITY = ("output_dir", "resume", "overwrite", "logger", "target.cache_dir", "data.cache_dir", "data.num_proc",
                "train.max_minutes", "train.log_every", "train.save_every", "train.keep_last", "train.eval_every",
                "train.eval_prompts", "train.eval_new_tokens", "train.eval_depth")

# Keys a launch may change and still continue the run with resume=auto (elastic resume, as HF Trainer and torchtune
# do): how many processes share the work and how long the schedule is. Weights, optimizer, schedule position and the
# epoch's progress carry over; the data order from the next batch on and the LR curve past the old end are the new
# launch's. The change is said in one line and recorded in run.json ("elastic"). resume=exact refuses them as any key.
ELASTIC = ("processes", "train.max_steps", "train.epochs")
FINGERPRINT = "target_identity.fingerprint"  # target/model.py same_fingerprint: also the one recorded before issue 63

# Keys the shared `train:` schema held before each recipe owned its loss (issue 51). A recipe's OLD_KEYS (a
# module-level dict in its train.py) says, old key -> new key, where each went, or None where the recipe never read
# it (the "unused" train.* lines): a run recorded before the move continues as the same run (resume_point reads old
# records through it), and the old name on the command line is refused naming the new one (moved_keys).
EAGLE1_TRAIN_KEYS = ("w_feat", "w_tok", "topk", "w_topk", "noise_std")
UNREAD = {f"train.{k}": None for k in EAGLE1_TRAIN_KEYS}


def old_keys(recipe: Optional[str]) -> dict[str, Optional[str]]:
    """The OLD_KEYS of the recipe a record names ("methods/<name>/train.py"; {} for one not registered or with none)."""
    import importlib

    from selfspec.registry import method, names

    module = "selfspec." + str(recipe).removesuffix(".py").replace("/", ".")
    if module not in {method(n).recipe for n in names()}:
        return {}
    return dict(getattr(importlib.import_module(module), "OLD_KEYS", {}))


def moved_keys(old: dict[str, Optional[str]]) -> dict[str, str]:
    """A recipe's moved keys, old -> new (its schema's RENAMED: `train.w_feat=1` on the command line is refused
    naming eagle.w_feat, where Hydra alone would only call it unknown)."""
    return {k: new for k, new in old.items() if new}


@dataclass
class Resumed:
    """The checkpoint a run continues from: its folder and what train.state.load_state read from it."""

    folder: Path
    head_state: dict[str, torch.Tensor]
    trainer: dict  # optimizer, scheduler, torch_rng
    position: dict  # step, epoch, batch, target (+ what the recipe saved)


@dataclass
class RunRecord:
    """What a launch writes in output_dir with its first checkpoint (train.loop.save)."""

    identity: dict  # flat dotted config keys -> values: what shapes the run's result (run.json, every checkpoint)
    config: str  # this launch's composed config, YAML (config.yaml)
    replace: bool = False  # overwrite=true found another run there: its checkpoints go at the first save
    written: bool = False  # run.json and config.yaml are written (once per launch)
    elastic: list = field(default_factory=list)  # run.json's history of elastic resumes, this launch's last


def run_record(cfg, recipe: str, target_identity: dict, sequences: int, accelerator) -> RunRecord:
    """This launch's record. The identity is what shapes a run's result, as flat dotted keys: the recipe, the
    target's identity (its weights' fingerprint), the composed config minus NOT_IDENTITY, the process count and
    FSDP (they set the data order and the checkpoint's layout) and the number of training sequences (the data as
    read, not only as named)."""
    from accelerate.utils import DistributedType
    from omegaconf import OmegaConf

    config = flatten(OmegaConf.to_container(cfg, resolve=True))
    identity = {"recipe": recipe, **flatten(target_identity, "target_identity."),
                **{k: v for k, v in config.items() if not any(k == n or k.startswith(n + ".") for n in NOT_IDENTITY)},
                "processes": accelerator.num_processes, "fsdp": accelerator.distributed_type == DistributedType.FSDP,
                "sequences": sequences}
    # as run.json and position.json will read it back
    return RunRecord(json.loads(json.dumps(identity, default=str)), OmegaConf.to_yaml(cfg))


def resume_point(cfg, record: RunRecord, target_identity: dict, accelerator) -> Optional[Resumed]:
    """What this run does with output_dir (it writes nothing here: see the module docstring).

    - empty: start fresh.
    - holds a run and overwrite=true: start fresh; that run's checkpoints and record are replaced at the first
      save (said in one line then).
    - holds a run and resume=never: refused (the two runs' checkpoints would mix).
    - resume=auto: continue from the newest checkpoint if it is THIS run (the target is checked first, then the
      identity), also when only ELASTIC keys changed (said, and recorded in run.json); another run is refused
      naming the first key that differs. resume=exact: the same, but any change is refused. Checkpoints written
      before runs had an identity are continued as this run (the target and head shape are still checked), and say
      so."""
    out, identity = Path(cfg.output_dir), record.identity
    found = list_checkpoints(out)
    has_record = (out / RUN_FILE).exists()
    orphan_head = not found and not has_record and ((out / "head").exists() or (out / "ckpt.pt").exists())
    if (found or has_record or orphan_head) and cfg.overwrite:
        record.replace = True
        accelerator.print(f"[train] overwrite=true: starting fresh; the run in {out} is replaced at the first save")
        return None
    if (found or has_record) and cfg.resume == "never":
        what = f"checkpoints up to step {step_of(found[-1])}" if found else f"a {RUN_FILE}"
        raise UserError(f"output_dir '{out}' holds a run ({what}) and resume=never would mix this run's checkpoints "
                        f"with it; pass overwrite=true to replace it, resume=auto to continue it, or another "
                        "output_dir")
    if orphan_head:
        raise UserError(f"output_dir '{out}' holds a head (head/ or ckpt.pt) but no {RUN_FILE} of the run that made "
                        f"it; pass overwrite=true to replace it, or another output_dir")
    check_config_file(cfg, out)
    recorded = _recorded_identity(out) if has_record else None
    resumed = Resumed(found[-1], *load_state(found[-1], target_identity)) if found else None
    changed = {}
    for other in (resumed.position.get("run") if resumed else None, recorded):
        other = renamed(other)
        if isinstance(other, dict) and same_fingerprint(other.get(FINGERPRINT), identity.get(FINGERPRINT)):
            other = {**other, FINGERPRINT: identity.get(FINGERPRINT)}  # recorded before issue 63: the same target
        if other is None or other == identity:
            continue
        diff = [k for k in dict.fromkeys([*identity, *other]) if identity.get(k, "absent") != other.get(k, "absent")]
        fixed = [k for k in diff if cfg.resume == "exact" or k not in ELASTIC]
        if fixed:
            key = fixed[0]
            hint = (" (resume=exact refuses any change; resume=auto continues a run on another process count or "
                    "schedule length)" if key in ELASTIC else "")
            raise UserError(f"output_dir '{out}' holds another run ({key}={other.get(key, 'absent')} there, "
                            f"{key}={identity.get(key, 'absent')} here){hint}; pass another output_dir, or "
                            f"overwrite=true to replace it")
        changed.update({k: [other.get(k), identity.get(k)] for k in diff})
    if has_record:
        record.elastic = _recorded(out).get("elastic", [])
    if changed and resumed is not None:
        step = resumed.position["step"]
        record.elastic = [*record.elastic, {"step": step, "changed": changed}]
        said = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items())
        accelerator.print(f"[train] resume=auto: continuing the run in {out} from step {step} with {said} (elastic "
                          f"resume, recorded in {RUN_FILE}; resume=exact refuses such changes)")
    if resumed is not None and "run" not in resumed.position:
        accelerator.print(f"[train] {resumed.folder} has no run identity (an older selfspec): continuing it as this "
                          "run")
    if resumed is None and cfg.resume == "auto":
        accelerator.print(f"[train] resume=auto: no checkpoint in {checkpoint_dir(out)}; starting fresh")
    return resumed


def check_config_file(cfg, out: Path) -> None:
    """A launch rewrites output_dir's config.yaml: refused in one line if it is not as selfspec wrote it (a note the
    user added there would be lost; core/ownership.config_kind)."""
    from selfspec.core.ownership import config_kind, proves

    path = out / CONFIG_FILE
    if path.exists() and not proves(config_kind(cfg), path):
        raise UserError(f"output_dir '{out}': its {CONFIG_FILE} was changed since selfspec wrote it (a note added?), "
                        f"and this launch rewrites it: move what you added to another file, or pass another "
                        f"output_dir (overwrite=true replaces the run, {CONFIG_FILE} included)")


def same_run(identity: Any) -> Callable[[Any], bool]:
    """Whether a checkpoint's recorded run identity is this run's (`identity`) or an earlier launch's of it, which
    differs only in ELASTIC keys: keep_last counts both (train/state.save_state prunes them)."""
    def steady(run: dict) -> dict:
        return {k: v for k, v in renamed(run).items() if k not in ELASTIC}

    def test(other: Any) -> bool:
        if not isinstance(other, dict) or not isinstance(identity, dict):
            return other == identity
        return steady(other) == steady(identity)
    return test


def renamed(identity: Optional[dict]) -> Optional[dict]:
    """A recorded identity with its keys as this selfspec names them (its recipe's OLD_KEYS), in their recorded
    order."""
    if not isinstance(identity, dict):
        return identity
    moved = old_keys(identity.get("recipe"))
    return {moved.get(k, k): v for k, v in identity.items() if moved.get(k, k) is not None}


_held = None  # this process's output_dir lock (selfspec.core.atomic): held until the run ends, the process dies, or the
# process starts its next run (in-process callers: tests, scripts/sweep_exit.py)


def hold_output_dir(accelerator, output_dir: Path, new: bool | Path = False) -> None:
    """Rank 0 takes output_dir's writer lock (selfspec.core.atomic.acquire_lock, an flock the kernel drops when the
    process dies) before anything is written there, and tells every rank whether it got it: a second run on the same
    folder is refused in one line on every rank, so the whole launch exits 2 (no rank hangs at a collective)."""
    global _held
    release_output_dir()
    refusal = None
    if accelerator.is_main_process:
        from selfspec.core.atomic import acquire_lock

        try:
            _held = acquire_lock(output_dir, new=new)
        except UserError as e:
            refusal = str(e)
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        box = [refusal]
        broadcast_object_list(box, from_process=0)
        refusal = box[0]
    if refusal:
        raise UserError(refusal)


def release_output_dir() -> None:
    """Drop this process's output_dir lock (the end of a run; a process's exit drops it anyway)."""
    global _held
    if _held is not None:
        _held.release()
        _held = None


def check_run_folder(out: Path, tracker_dirs: tuple[str, ...] = (), inputs=()) -> None:
    """output_dir is new, empty, or a run's (core/ownership.py's rule; a run writes only its own names there and
    never deletes other files): a folder holding files but no run is refused before anything is written, so its
    config.yaml is never overwritten. `tracker_dirs`: what a launch killed before its first save may have left.
    `inputs`: (config key, path) of what the run reads (its data, features, a head to start from): output_dir
    may not be one, lie inside one or hold one."""
    from selfspec.core.ownership import Kind, check_output

    if str(out) in ("", "."):
        raise UserError("output_dir is empty; pass output_dir=<a folder for this run> (never the current folder)")

    def run_files(folder: Path) -> Optional[list[str]]:
        names = [p.name for p in folder.iterdir()]
        if (folder / RUN_FILE).exists() or checkpoint_dir(folder).exists() or {"head", "ckpt.pt"} & set(names):
            return names  # a run (an orphan head is resume_point's to refuse)
        return names if set(names) <= set(tracker_dirs) | {".selfspec.lock"} else None

    check_output(out, "output_dir", Kind("training run", folder=True, mine=run_files), inputs=inputs)
    for step in list_checkpoints(out):  # a launch prunes and replaces step folders (resume and overwrite alike)
        refuse_head_folder(step)
        foreign = foreign_entries(step)
        if foreign:
            names = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
            raise UserError(f"output_dir '{out}': {step.relative_to(out)} holds other files ({names}) that selfspec "
                            f"did not write, which pruning or replacing that checkpoint would delete (resume and "
                            f"overwrite=true alike): move them out of {checkpoint_dir(out).name}/, or pass another "
                            f"output_dir")


def _recorded_identity(out: Path) -> dict:
    return _recorded(out)["identity"]


def _recorded(out: Path) -> dict:
    """run.json: {"identity": ..., "elastic": [...]}; unreadable is one line."""
    path = out / RUN_FILE
    try:
        data = json.loads(path.read_text())
        data["identity"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"'{path}' is unreadable ({type(e).__name__}); pass overwrite=true to replace the run in "
                        f"'{out}', or another output_dir") from e
    if not isinstance(data["identity"], dict) or not isinstance(data.get("elastic", []), list):
        raise UserError(f"'{path}' is not a run record (its identity must be an object, its elastic a list); pass "
                        f"overwrite=true to replace the run in '{out}', or another output_dir")
    return data


def replace_old_run(out: Path, record: RunRecord) -> None:
    """Rank 0, at a launch's first save, if overwrite=true found another run: its checkpoints are renamed away
    first (a kill leaves no half), then deleted; said in one line. What else checkpoints/ held (a user's notes) is
    moved back first: overwrite removes what selfspec wrote, nothing else."""
    import os
    import shutil

    if record.replace:
        found = list_checkpoints(out)
        root = checkpoint_dir(out)
        if root.exists():
            os.replace(root, out / f".trash-checkpoints-{os.getpid()}")
        for trash in out.glob(".trash-checkpoints-*"):  # this one, and any a killed overwrite left
            for entry in list(trash.iterdir()):
                if not (entry.is_dir() and step_of(entry) is not None) and ".tmp-" not in entry.name:
                    root.mkdir(exist_ok=True)
                    os.replace(entry, root / entry.name)  # the user's, not a checkpoint or a half-written one
            shutil.rmtree(trash, ignore_errors=True)
        newest = f" (newest {found[-1].name})" if found else ""
        print(f"[train] overwrite=true: removed the run that was in {out}: {len(found)} checkpoints{newest}; its "
              f"head/ and ckpt.pt stay until this run writes its own", flush=True)
        record.replace = False


def write_record(out: Path, record: RunRecord) -> None:
    """Rank 0, once the launch's first checkpoint is on disk: run.json and config.yaml. After it, not before: a
    launch whose first save fails (a full disk) leaves the folder as it found it; the checkpoint itself carries
    the identity, so a kill between the two loses nothing."""
    from selfspec.core.atomic import write_json, write_text

    write_json(out / RUN_FILE, {"identity": record.identity, **({"elastic": record.elastic} if record.elastic else {})})
    write_text(out / CONFIG_FILE, record.config)
    record.written = True
