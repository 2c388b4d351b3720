"""Run SafeAILab/EAGLE's own EAGLE-1 trainer on selfspec's data, for an equal-compute comparison (#22).

    selfspec cache-features data=smollm2_regen data.features_dir=feats/          # the target's features, once
    python3 -m venv eagle-venv && eagle-venv/bin/pip install torch==2.13.0 transformers==4.53.3 accelerate==0.26.0 \
        wandb safetensors                                                        # its requirements (transformers 4)
    python scripts/peer_eagle.py eagle_repo=<SafeAILab/EAGLE checkout> features_dir=feats/ out=runs/peer \
        minutes=60 threads=1 python=eagle-venv/bin/python
    python scripts/eval_heads.py data=smollm2_regen +heads.peer=runs/peer/heads/minute_60 ...

The reference trainer is `eagle/train/main.py` with its model `eagle/model/cnets1.py` (EAGLE-1: fc 2H->H with a
bias, one decoder layer, the target's frozen lm_head over the full vocabulary; SmoothL1 on features + 0.1 soft CE,
uniform feature noise, AdamW 3e-5 with 2000 warmup steps, batch 4, bf16 autocast, gradient checkpointing). Its
model, loss, schedule and hyper-parameters run as written (`lr=` and `warmup_steps=` change the two schedule
numbers when asked, for diagnosis); only plumbing is adapted, and the adaptation is saved as `out/patch.diff`:
- data: each training sequence of a selfspec features cache (the same tokenised sequences, loss masks and bf16
  target features selfspec's own recipe trains on) becomes one `data_<i>.ckpt` holding {input_ids, hidden_state,
  loss_mask}, the layout EAGLE's ge_data scripts write;
- the base model folder it reads the lm_head and embedding from: the target's config, one safetensors file with
  `lm_head.weight` and `model.embed_tokens.weight` (SmolLM2 ties them, so its own file has no lm_head), and the
  index file EAGLE looks them up in; the head's config: the target's with one layer, in the Llama-2 key names
  EAGLE's EConfig reads (rope_theta, rope_scaling);
- main.py: `.cuda()` becomes the accelerator's device, and a wall-clock budget (`selfspec_budget.py`, written
  beside it) saves the head every `snapshot_minutes` and stops the run after `minutes`. The clock starts when its
  training loop does; its own epoch-end evaluation counts against it, as selfspec's does in its own runs.
wandb runs offline. Each snapshot is then imported as a selfspec head (selfspec.publish.importer) into
`out/heads/minute_<m>`, so scripts/eval_heads.py measures it on the same held-out prompts as ours.
"""

from __future__ import annotations

import difflib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from tqdm.auto import tqdm

from selfspec.core.atomic import write_json
from selfspec.core.cli import entry, save_config
from selfspec.core.ownership import refuse_inputs
from selfspec.core.errors import UserError
from selfspec.core.target import TargetConfig, load_target_from_config
from selfspec.data.features import OfflineFeatures

PLACEHOLDER = "???"
TRAINER, MODEL = "eagle/train/main.py", "eagle/model/cnets1.py"
# Plumbing edits to main.py: (what it says, what it says here, how many times it says it at commit cb7e084).
PATCHES = [
    (".cuda()", ".to(accelerator.device)", 5),
    ("for epoch in range(num_epochs + 1):",
     "from . import selfspec_budget as _budget\n_budget.start()\nfor epoch in range(num_epochs + 1):", 1),
    ("    for batch_idx, data in enumerate(tqdm(train_loader)):\n",
     "    for batch_idx, data in enumerate(tqdm(train_loader)):\n"
     "        _budget.tick(accelerator, model, args.cpdir, data)\n", 1),
]
BUDGET = '''"""Written by selfspec's scripts/peer_eagle.py: a wall-clock budget for main.py (snapshots, then a stop)."""
import atexit, json, os, sys, time
from safetensors.torch import save_file

MINUTES = float(os.environ["SELFSPEC_MINUTES"])
EVERY = float(os.environ["SELFSPEC_SNAPSHOT_MINUTES"])
_t0, _steps, _tokens, _next, _last = None, 0, 0, EVERY, None


def start():
    global _t0
    _t0 = time.time()
    atexit.register(_at_exit)


def _at_exit():
    """The trainer ran all its epochs inside the budget: its final head is a snapshot too."""
    if _last is not None:
        _save(*_last, round((time.time() - _t0) / 60, 2))


def _save(accelerator, model, cpdir, minute):
    if accelerator.is_main_process:
        out = os.path.join(cpdir, f"minute_{minute:g}")
        os.makedirs(out, exist_ok=True)
        state = {k: v.detach().float().contiguous() for k, v in accelerator.unwrap_model(model).state_dict().items()}
        save_file(state, os.path.join(out, "model.safetensors"))
        meta = {"minute": minute, "seconds": round(time.time() - _t0, 1), "steps": _steps, "tokens": _tokens}
        with open(os.path.join(out, "progress.json"), "w") as f:
            json.dump(meta, f)
        print(f"[selfspec budget] {meta}", flush=True)


def tick(accelerator, model, cpdir, batch):
    """Called before each training step: a snapshot at every EVERY minutes, the stop at MINUTES."""
    global _steps, _tokens, _next, _last
    _last = (accelerator, model, cpdir)
    minutes = (time.time() - _t0) / 60
    while _next < MINUTES and minutes >= _next:
        _save(accelerator, model, cpdir, _next)
        _next += EVERY
    if minutes >= MINUTES:
        _last = None
        _save(accelerator, model, cpdir, MINUTES)
        sys.exit(0)
    _steps += 1
    _tokens += int(batch["attention_mask"].sum())
'''


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


def patched_trainer(text: str, warmup_steps: Optional[int] = None) -> str:
    patches = PATCHES + ([('"num_warmup_steps": 2000,', f'"num_warmup_steps": {int(warmup_steps)},', 1)]
                         if warmup_steps is not None else [])
    for old, new, count in patches:
        if text.count(old) != count:
            raise UserError(f"{TRAINER} says {old.strip()!r} {text.count(old)} times, not {count}: this script "
                            "adapts commit cb7e084; check the patch against your checkout")
        text = text.replace(old, new)
    return text


def write_base(target, base: Path) -> None:
    """The folder EAGLE reads the lm_head and embedding from, and the target's config."""
    from safetensors.torch import save_file

    base.mkdir(parents=True)
    target.model.config.save_pretrained(base)
    tensors = {"lm_head.weight": target.model.get_output_embeddings().weight.detach().float().clone(),
               "model.embed_tokens.weight": target.model.get_input_embeddings().weight.detach().float().clone()}
    save_file(tensors, str(base / "head_and_embedding.safetensors"), metadata={"format": "pt"})
    (base / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: "head_and_embedding.safetensors" for k in tensors}}, indent=2))


def head_config(target_config) -> dict:
    """One decoder layer of the target, as the engines' EAGLE configs say it (publish/export.layer_config), plus
    what EAGLE's EConfig and cnets1 read in transformers 4.3x Llama names: rope_scaling (None: default RoPE) and
    pretraining_tp."""
    from selfspec.publish.export import layer_config

    rope = getattr(target_config.get_text_config(), "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise UserError(f"EAGLE's cnets1 knows default RoPE only; this target's is '{rope.get('rope_type')}'")
    return layer_config(target_config, 1, torch.float32, architectures=["LlamaForCausalLM"], rope_scaling=None,
                        pretraining_tp=1, tie_word_embeddings=False)


def write_data(feats: OfflineFeatures, folder: Path) -> int:
    """One .ckpt per sequence, as EAGLE's ge_data scripts write them (fp32 values of the cache's bf16 features)."""
    folder.mkdir(parents=True)
    tokens = 0
    for i in tqdm(range(len(feats)), desc="EAGLE data", unit="seq"):
        row = feats[i]
        tokens += len(row["input_ids"])
        torch.save({"input_ids": torch.tensor(row["input_ids"], dtype=torch.long),
                    "hidden_state": row["features"].float(),
                    "loss_mask": torch.tensor(row["loss_mask"], dtype=torch.long)}, folder / f"data_{i}.ckpt")
    return tokens


def commit_of(repo: Path) -> str:
    try:
        return subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


def train(cfg: PeerEagleConfig, out: Path) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": str(cfg.threads), "MKL_NUM_THREADS": str(cfg.threads),
           "WANDB_MODE": "offline", "WANDB_DIR": str(out.resolve()), "SELFSPEC_MINUTES": str(cfg.minutes),
           "SELFSPEC_SNAPSHOT_MINUTES": str(cfg.snapshot_minutes), "PYTHONPATH": str((out / "src").resolve())}
    cmd = [cfg.python, "-m", "eagle.train.main", "--basepath", str((out / "base").resolve()),
           "--configpath", str((out / "head_config.json").resolve()), "--tmpdir", str((out / "data").resolve()),
           "--cpdir", str((out / "ckpt").resolve()), *(["--lr", str(cfg.lr)] if cfg.lr is not None else [])]
    print("[peer] " + " ".join(cmd), flush=True)
    with open(out / "train.log", "w") as log:
        return subprocess.run(cmd, cwd=out / "src", env=env, stdout=log, stderr=subprocess.STDOUT).returncode


def import_snapshots(out: Path, target) -> list[dict]:
    """Each snapshot as a selfspec head (out/heads/minute_<m>), its progress in the record's training summary."""
    from selfspec.publish.importer import imported_head, write_import

    rows = []
    for snap in sorted((out / "ckpt").glob("minute_*"), key=lambda p: float(p.name.split("_")[1])):
        progress = json.loads((snap / "progress.json").read_text())
        head = imported_head(snap, target, fmt="eagle", config=str(out / "head_config.json"))
        head.record["training"] = {"trainer": "SafeAILab/EAGLE eagle/train/main.py", "steps": progress["steps"],
                                   "train_seconds": progress["seconds"], "tokens": progress["tokens"],
                                   "tokens_per_s": round(progress["tokens"] / max(progress["seconds"], 1e-9), 1)}
        write_import(head, out / "heads" / snap.name)
        rows.append({"head": str(out / "heads" / snap.name), **progress})
    return rows


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
