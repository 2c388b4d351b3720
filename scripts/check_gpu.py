"""The GPU check (`make check-gpu`): what selfspec does on one GPU, in minutes, from a checkout.

    python scripts/check_gpu.py [out_dir=outputs/check_gpu] [train_minutes=0.5] [flagship_minutes=0]

Phases, each a real command with its own time limit (one failing is reported and the rest still run):
  env        torch, the GPU, its bf16 support; whether vLLM imports (it is not a dependency)
  ddp        the flagship's demo recipe (registry.FLAGSHIP: EAGLE-3) on SmolLM2 in bf16 through `accelerate launch`
             with conf/accelerate/gpu_ddp.yaml
  fsdp       the same with conf/accelerate/gpu_fsdp.yaml (FSDP2, one process)
  flagship   (flagship_minutes > 0) a DFlash head on all regenerated data in bf16: a 15-step probe sizes the
             schedule so the cosine LR ends inside the budget, then the run (its head is out_dir/dflash/head)
  bench      scripts/bench.py on the GPU: the target alone, HF greedy and every head trained above
Prints one table (tokens/s, peak GPU memory, held-out tau, wall seconds per phase) and writes out_dir/report.json.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from selfspec.core.atomic import write_json
from selfspec.core.cli import entry
from selfspec.core.errors import UserError
from selfspec.registry import FLAGSHIP, method

# The phases: each one a real command run from the checkout (a recipe through `accelerate launch`, or scripts/bench.py)
# with its own time limit and its output in a log beside the report, and the figures it recorded.

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
    return method(kind).recipe.removeprefix("selfspec.").replace(".", "/") + ".py"


def train_phase(name: str, config: str, out: Path, minutes: float, target: str) -> dict:
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
    rc, _ = _run(_launch("gpu_1", recipe_path("dflash"), *base, "train.max_steps=15", "train.eval_prompts=1",
                         "train.eval_every=0", f"output_dir={probe}"), out / "flagship_probe.log", 300)
    r = _result(probe)
    if rc != 0 or not r.get("train_seconds"):
        return {"rc": rc, "error": "the probe failed"}
    # the probe's first steps warm CUDA up (its 15 steps took 0.3-1.0 s each on an H200, 0.19 s after them): the run
    # is sized by the steady step time, and a 5% margin for its four evals
    step_s = r.get("steady_step_s") or r["train_seconds"] / r["steps"]
    steps = max(int(minutes * 60 * 0.95 / step_s), 1)
    run_dir = out / "dflash"
    rc, wall = _run(_launch("gpu_1", recipe_path("dflash"), *base, f"train.max_steps={steps}",
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


@dataclass
class CheckGpuConfig:
    """Schema of conf/check_gpu.yaml."""

    out_dir: str = field(default="outputs/check_gpu", metadata={"help": "a new folder for every run's outputs"})
    train_minutes: float = field(default=0.5, metadata={"help": "training budget of the ddp and fsdp phases"})
    flagship_minutes: float = field(default=0.0, metadata={"help": "DFlash flagship budget (0 = skip the phase)"})
    flagship_args: list[str] = field(default_factory=list, metadata={"help": "more overrides for the flagship run"})
    bench_prompts: int = field(default=6, metadata={"help": "held-out prompts decoded per method in the bench phase"})
    target_name: str = field(default="smollm2-135m",
                             metadata={"help": "the target config of every phase (conf/target)"})
    phases: list[str] = field(default_factory=lambda: ["env", "ddp", "fsdp", "flagship", "bench"],
                              metadata={"help": "which phases to run, in order"})


def table(report: dict) -> str:
    rows = ["| phase | rc | wall s | distributed | tokens/s | peak GPU MiB | held-out tau |",
            "|---|---|---|---|---|---|---|"]
    for name in ("ddp", "fsdp", "flagship"):
        r = report.get(name)
        if r:
            tau = r.get("heldout", {}).get("tau")
            rows.append(f"| {name} | {r.get('rc')} | {r.get('wall_s')} | {r.get('distributed_type', '-')} | "
                        f"{r.get('tokens_per_s', '-')} | {r.get('peak_gpu_mib', '-')} | "
                        f"{'-' if tau is None else f'{tau:.3f}'} |")
    bench = report.get("bench", {})
    methods = {k: v for k, v in bench.items() if isinstance(v, dict)}
    if methods:
        rows += ["", "| method | tau | tokens/s | speedup | identical |", "|---|---|---|---|---|"]
        rows += [f"| {m} | {v.get('tau', '-')} | {v.get('tokens_per_s', '-')} | {v.get('speedup', '-')} | "
                 f"{v.get('identical', '-')} |" for m, v in methods.items()]
    return "\n".join(rows)


@entry("check_gpu", CheckGpuConfig)
def main(cfg: CheckGpuConfig) -> dict:
    unknown = set(cfg.phases) - {"env", "ddp", "fsdp", "flagship", "bench"}
    if unknown:
        raise UserError(f"unknown phases {sorted(unknown)}; use env, ddp, fsdp, flagship, bench")
    out = Path(cfg.out_dir)
    if out.exists():
        raise UserError(f"out_dir {out} exists: every check writes a new folder (pass another out_dir)")
    env = env_phase()
    if not env["gpu"]:
        raise UserError("no CUDA GPU is visible to torch: the GPU check needs one (CPU runs: make demo / make test)")
    out.mkdir(parents=True)
    report: dict = {"env": env}
    print(f"[check-gpu] {json.dumps(env)}", flush=True)
    for phase in cfg.phases:
        if phase in ("ddp", "fsdp"):
            report[phase] = train_phase(phase, f"gpu_{phase}", out, cfg.train_minutes, cfg.target_name)
        elif phase == "flagship" and cfg.flagship_minutes > 0:
            report[phase] = flagship_phase(out, cfg.flagship_minutes, cfg.target_name, list(cfg.flagship_args))
        elif phase == "bench":
            heads = {n: out / d / "head" for n, d in (("e3", "ddp"), ("flash", "dflash"))
                     if (out / d / "head" / "model.safetensors").exists()}
            report[phase] = bench_phase(out, heads, cfg.bench_prompts, cfg.target_name)
        write_json(out / "report.json", json.loads(json.dumps(report, default=str)))  # after every phase
    print(table(report), flush=True)
    return report


if __name__ == "__main__":
    main()
