"""The phases of the GPU check (scripts/check_gpu.py, `make check-gpu`): each one a real command run from the checkout
(a recipe through `accelerate launch`, or scripts/bench.py) with its own time limit and its output in a log beside
the report, and the figures it recorded.

  env        torch, the GPU, its bf16 support; whether vLLM imports (it is not a dependency)
  train      a recipe (registry.FLAGSHIP's demo experiment on SmolLM2, in bf16) under one accelerate config (gpu_ddp,
             gpu_fsdp)
  flagship   a DFlash head on all regenerated data in bf16: a 15-step probe sizes the schedule so the cosine LR
             ends inside the budget, then the run
  bench      scripts/bench.py on the GPU: the target alone, HF greedy and the heads given
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd: list[str], log: Path, timeout: float) -> tuple[int, float]:
    """Run cmd from the checkout with its output in `log`; (exit status, wall seconds). 124 = timed out."""
    t0 = time.time()
    with log.open("w") as f:
        print(f"[check-gpu] $ {' '.join(cmd)}", flush=True)
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    wall = time.time() - t0
    print(f"[check-gpu] rc {rc} in {wall:.0f} s (log {log})" + ("" if rc == 0 else ":\n" + _tail(log)), flush=True)
    return rc, wall


def _tail(log: Path, n: int = 15) -> str:
    return "\n".join(log.read_text(errors="replace").replace("\r", "\n").splitlines()[-n:])


def _launch(config: str, recipe: str, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"conf/accelerate/{config}.yaml",
            "--num_processes", "1", "--num_machines", "1", recipe, *overrides]


def _result(run_dir: Path) -> dict:
    """The figures a finished run recorded (its head's config.json `training`), or {}."""
    try:
        return json.loads((run_dir / "head" / "config.json").read_text()).get("training", {})
    except (OSError, ValueError):
        return {}


def env_phase() -> dict:
    import torch

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": None, "bf16": False}
    if torch.cuda.is_available():
        info.update(gpu=torch.cuda.get_device_name(0), bf16=torch.cuda.is_bf16_supported(),
                    memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1))
    try:
        import vllm  # noqa: F401  (optional: only reported)
        info["vllm"] = vllm.__version__
    except Exception as e:  # not installed, or a build for another torch/CUDA
        info["vllm"] = f"not importable: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return info


def recipe_path(kind: str) -> str:
    """A head type's recipe as a file of the checkout (what `accelerate launch` runs)."""
    from selfspec.registry import method

    return method(kind).recipe.removeprefix("selfspec.").replace(".", "/") + ".py"


def train_phase(name: str, config: str, out: Path, minutes: float, target: str) -> dict:
    from selfspec.registry import FLAGSHIP

    run_dir = out / name
    args = [f"experiment=demo_{FLAGSHIP}", f"target={target}", "data=smollm2_regen_all", "train.mixed_precision=bf16",
            "train.features_dtype=bfloat16", f"train.max_minutes={minutes}", "train.epochs=1", "train.batch_size=16",
            "train.feature_memo_gb=0", "train.eval_every=0", "train.save_every=0", "train.eval_prompts=8",
            f"output_dir={run_dir}"]
    rc, wall = _run(_launch(config, recipe_path(FLAGSHIP), *args), out / f"{name}.log", minutes * 60 + 240)
    return {"rc": rc, "wall_s": round(wall),
            **{k: v for k, v in _result(run_dir).items() if k not in ("data", "train")}}


def flagship_phase(out: Path, minutes: float, target: str, extra: list[str]) -> dict:
    """A 15-step probe measures the step time; the run's epochs are set so its cosine schedule ends in budget."""
    base = ["experiment=smollm2_dflash_full", f"target={target}", "data=smollm2_regen_all", "draft.vocab_size=null",
            "draft.block_size=16", "dflash.anchors=256", "train.batch_size=16", "train.lr=6.0e-4",
            "train.warmup_steps=100", "train.feature_memo_gb=0", "train.eval_prompts=16", *extra]
    probe = out / "flagship_probe"
    rc, _ = _run(_launch("gpu_1", "methods/dflash/train.py", *base, "train.max_steps=15", "train.eval_prompts=1",
                         "train.eval_every=0", f"output_dir={probe}"), out / "flagship_probe.log", 300)
    r = _result(probe)
    if rc != 0 or not r.get("train_seconds"):
        return {"rc": rc, "error": "the probe failed"}
    # the probe's first steps warm CUDA up (its 15 steps took 0.3-1.0 s each on an H200, 0.19 s after them): the run
    # is sized by the steady step time, and a 5% margin for its four evals
    step_s = r.get("steady_step_s") or r["train_seconds"] / r["steps"]
    steps = max(int(minutes * 60 * 0.95 / step_s), 1)
    run_dir = out / "dflash"
    rc, wall = _run(_launch("gpu_1", "methods/dflash/train.py", *base, f"train.max_steps={steps}",
                            f"train.max_minutes={minutes * 1.1:.2f}", f"train.eval_every={max(steps // 4, 1)}",
                            f"train.save_every={max(steps // 4, 1)}", f"output_dir={run_dir}"),
                    out / "flagship.log", minutes * 60 * 1.1 + 240)
    return {"rc": rc, "wall_s": round(wall), "planned_steps": steps, "probe_step_s": round(step_s, 4),
            **{k: v for k, v in _result(run_dir).items() if k not in ("data", "train", "dflash")}}


def bench_phase(out: Path, heads: dict[str, Path], prompts: int, target: str) -> dict:
    args = [f"target={target}", "data=smollm2_regen", f"heldout_prompts={prompts}", f"max_prompts={prompts}",
            "max_new_tokens=128", "sweep_k=[]", "device=cuda", f"output_file={out / 'bench.json'}"]
    methods = ["target", "hf_greedy"]
    for name, head in heads.items():
        args.append(f"+heads.{name}={head}")
        methods += [name] + ([f"{name}_tree"] if name == "e3" else [])  # DFlash drafts blocks, no trees
    rc, wall = _run([sys.executable, "scripts/bench.py", *args, f"methods=[{','.join(methods)}]"],
                    out / "bench.log", 600)
    try:
        return {"rc": rc, "wall_s": round(wall), **json.loads((out / "bench.json").read_text())["methods"]}
    except (OSError, ValueError, KeyError):
        return {"rc": rc, "wall_s": round(wall)}
