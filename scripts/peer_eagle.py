"""Run SafeAILab/EAGLE's own EAGLE-1 trainer on selfspec's data, for an equal-compute comparison (#22).

    selfspec cache-features data=smollm2_regen data.features_dir=feats/          # the target's features, once
    python3 -m venv eagle-venv && eagle-venv/bin/pip install torch==2.13.0 transformers==4.53.3 accelerate==0.26.0 \
        wandb safetensors                                                        # its requirements (transformers 4)
    python scripts/peer_eagle.py eagle_repo=<SafeAILab/EAGLE checkout> features_dir=feats/ out=runs/peer \
        minutes=60 threads=1 python=eagle-venv/bin/python
    python scripts/eval_heads.py data=smollm2_regen +heads.peer=runs/peer/heads/minute_60 ...

SafeAILab/EAGLE's model, loss, schedule and hyper-parameters run as written (`lr=` and `warmup_steps=` change the two
schedule numbers when asked, for diagnosis); only plumbing is adapted (its data, base model folder, `.cuda()` and a
wall-clock budget that snapshots the head every `snapshot_minutes` and stops after `minutes`: publish/peer_eagle.py
says what and how), and the adaptation is saved as `out/patch.diff`. wandb runs offline. Each snapshot is then
imported as a selfspec head (selfspec.publish.importer) into `out/heads/minute_<m>`, so scripts/eval_heads.py measures
it on the same held-out prompts as ours.
"""

from __future__ import annotations

import difflib
import json
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from selfspec.core.atomic import write_json
from selfspec.core.cli import entry, save_config
from selfspec.core.ownership import refuse_inputs
from selfspec.core.errors import UserError
from selfspec.target.model import TargetConfig, load_target_from_config
from selfspec.data.features import OfflineFeatures
from selfspec.publish.peer_eagle import (BUDGET, MODEL, TRAINER, commit_of, head_config, import_snapshots,
                                         patched_trainer, train, write_base, write_data)

PLACEHOLDER = "???"


@dataclass
class PeerEagleConfig:
    """Schema of conf/peer_eagle.yaml."""

    target: TargetConfig = field(default_factory=TargetConfig)
    eagle_repo: str = field(default=PLACEHOLDER, metadata={"help": (
        "A checkout of github.com/SafeAILab/EAGLE (compared here at commit cb7e084): its eagle/ package is copied "
        "into out/src and patched there, never in place.")})
    features_dir: str = field(default=PLACEHOLDER, metadata={"help": (
        "A selfspec features cache (scripts/cache_features.py) of the data to train on, for this target.")})
    out: str = field(default=PLACEHOLDER, metadata={"help": "A new folder for the run (refused if it exists)."})
    minutes: float = field(default=60.0, metadata={"help": "Wall-clock budget of the trainer's training loop."})
    snapshot_minutes: float = field(default=15.0, metadata={"help": (
        "Save the head every this many minutes (for tau against training minutes).")})
    lr: Optional[float] = field(default=None, metadata={"help": (
        "Passed as the trainer's own --lr (null: its default, 3e-5).")})
    warmup_steps: Optional[int] = field(default=None, metadata={"help": (
        "Replace its num_warmup_steps (2000) in main.py's train_config: a hyper-parameter, recorded in patch.diff "
        "(null: its default).")})
    threads: int = field(default=1, metadata={"help": "CPU threads of the trainer (OMP_NUM_THREADS)."})
    python: str = field(default=sys.executable, metadata={"help": "Interpreter that runs the trainer."})


def check(cfg: PeerEagleConfig) -> tuple[Path, Path, Path]:
    for key in ("eagle_repo", "features_dir", "out"):
        if str(getattr(cfg, key)).startswith(PLACEHOLDER):
            raise UserError(f"pass {key}=... (see `python scripts/peer_eagle.py --help`)")
    repo, feats, out = Path(cfg.eagle_repo), Path(cfg.features_dir), Path(cfg.out)
    missing = [p for p in (TRAINER, MODEL) if not (repo / p).is_file()]
    if missing:
        raise UserError(f"eagle_repo '{repo}' is not a SafeAILab/EAGLE checkout: no {', '.join(missing)}")
    if out.exists():
        raise UserError(f"out '{out}' exists; pass a new folder (a run never overwrites another)")
    refuse_inputs(out, "out", [("eagle_repo", repo), ("features_dir", feats)])
    if cfg.minutes <= 0 or cfg.snapshot_minutes <= 0 or cfg.threads < 1:
        raise UserError("minutes and snapshot_minutes must be > 0 and threads >= 1")
    if (cfg.lr is not None and cfg.lr <= 0) or (cfg.warmup_steps is not None and cfg.warmup_steps < 0):
        raise UserError("lr must be > 0 and warmup_steps >= 0")
    return repo, feats, out


@entry("peer_eagle", PeerEagleConfig)
def main(cfg: PeerEagleConfig) -> dict:
    repo, feats_dir, out = check(cfg)
    trainer = (repo / TRAINER).read_text()
    patched = patched_trainer(trainer, cfg.warmup_steps)
    target = load_target_from_config(cfg.target)
    feats = OfflineFeatures(feats_dir, target.identity)
    config = head_config(target.config)
    try:
        out.mkdir(parents=True)  # atomic: of two runs started on one out, exactly one gets it
    except FileExistsError:
        raise UserError(f"out '{out}' was made by another run meanwhile; pass a new folder (a run never overwrites "
                        f"another)") from None
    save_config(cfg, out / "config.yaml")
    shutil.copytree(repo / "eagle", out / "src" / "eagle", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (out / "src" / TRAINER).write_text(patched)
    (out / "src" / "eagle/train/selfspec_budget.py").write_text(BUDGET)
    (out / "patch.diff").write_text("".join(difflib.unified_diff(
        trainer.splitlines(True), patched.splitlines(True), f"a/{TRAINER}", f"b/{TRAINER}")))
    write_base(target, out / "base")
    write_json(out / "head_config.json", config)
    t0 = time.time()
    tokens = write_data(feats, out / "data")
    print(f"[peer] {len(feats)} sequences, {tokens} tokens -> {out / 'data'} ({time.time() - t0:.0f} s)", flush=True)
    t0 = time.time()
    rc = train(cfg, out)
    seconds = time.time() - t0
    if rc != 0:
        raise UserError(f"the EAGLE trainer exited with {rc}; see {out / 'train.log'}")
    rows = import_snapshots(out, target)
    result = {"trainer": "SafeAILab/EAGLE eagle/train/main.py", "commit": commit_of(repo), "lr": cfg.lr,
              "warmup_steps": cfg.warmup_steps, "sequences": len(feats),
              "tokens": tokens, "threads": cfg.threads, "minutes": cfg.minutes, "wall_seconds": round(seconds, 1),
              "snapshots": rows}
    write_json(out / "run.json", result)
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
