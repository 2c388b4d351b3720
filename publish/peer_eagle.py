"""Running SafeAILab/EAGLE's own EAGLE-1 trainer on selfspec's data, and importing its heads (what
scripts/peer_eagle.py drives for an equal-compute comparison, #22).

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

import json
import os
import subprocess
from pathlib import Path
from typing import Optional

import torch
from tqdm.auto import tqdm

from selfspec.core.errors import UserError

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
    """One decoder layer of the target, as the engines' EAGLE configs say it (publish/formats/base.layer_config), plus
    what EAGLE's EConfig and cnets1 read in transformers 4.3x Llama names: rope_scaling (None: default RoPE) and
    pretraining_tp."""
    from selfspec.publish.formats.base import layer_config

    rope = getattr(target_config.get_text_config(), "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise UserError(f"EAGLE's cnets1 knows default RoPE only; this target's is '{rope.get('rope_type')}'")
    return layer_config(target_config, 1, torch.float32, architectures=["LlamaForCausalLM"], rope_scaling=None,
                        pretraining_tp=1, tie_word_embeddings=False)


def write_data(feats, folder: Path) -> int:
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


def train(cfg, out: Path) -> int:
    """Run the patched trainer (out/src) on out/data, out/base and out/head_config.json, its output in out/train.log;
    its exit status. cfg: scripts/peer_eagle.py's config (threads, minutes, snapshot_minutes, lr, python)."""
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
