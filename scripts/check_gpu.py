"""The GPU check (`make check-gpu`): what selfspec does on one GPU, in minutes, from a checkout.

    python scripts/check_gpu.py [out_dir=outputs/check_gpu] [train_minutes=0.5] [flagship_minutes=0]

Phases, each a real command with its own time limit (one failing is reported and the rest still run):
  env        torch, the GPU, its bf16 support; whether vLLM imports (it is not a dependency)
  ddp        the SmolLM2 EAGLE-3 recipe in bf16 through `accelerate launch` with conf/accelerate/gpu_ddp.yaml
  fsdp       the same with conf/accelerate/gpu_fsdp.yaml (FSDP2, one process)
  flagship   (flagship_minutes > 0) a DFlash head on all regenerated data in bf16: a 15-step probe sizes the
             schedule so the cosine LR ends inside the budget, then the run (its head is out_dir/dflash/head)
  bench      scripts/bench.py on the GPU: the target alone, HF greedy and every head trained above
Prints one table (tokens/s, peak GPU memory, held-out tau, wall seconds per phase) and writes out_dir/report.json.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from selfspec.core.atomic import write_json
from selfspec.core.cli import entry
from selfspec.core.errors import UserError
from selfspec.train.gpu_check import bench_phase, env_phase, flagship_phase, train_phase


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
