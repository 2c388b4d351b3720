"""What this host computes, and what a run's rate means, printed where a long run starts (hosts differ most in bf16:
an AMX or AVX-512 BF16 CPU runs torch's bf16 matmul ~4x its fp32, an AVX2-only one slower than its fp32):

    start    torch.matmul's GFLOP/s in fp32 and in bf16 at the head's largest layer, and the precision the run computes
    warm     the run's training tokens a second after its first RATE_STEPS steps, and the hours the shipped flagship
             head's last training (registry.FLAGSHIP's head in heads/pretrained: its recorded seconds x tokens a
             second; a head continued from another records its last run only) would take at that rate: the figure
             to plan a long run by (a head of another size, another recipe)

Both count tokens as the loop does (every token of every sequence, however many steps a recipe unrolls on it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from selfspec.core.threads import machine
from selfspec.train.step_profile import matmul_gflops

LONG_STEPS = 100  # runs planned this long or longer print the host's figures (the tests' tiny runs do not)
RATE_STEPS = 20  # optimizer steps before the rate line
ROWS = 512  # the M of the measured matmul: a training micro-batch's tokens, about
SHIPPED = Path(__file__).resolve().parents[1] / "heads" / "pretrained"


def largest_layer(head: torch.nn.Module) -> tuple[int, int]:
    """(in, out) features of the head's largest Linear (its lm_head, or its MLP where the draft vocabulary is small);
    (1024, 1024) for a head with none."""
    linears = [m for m in head.modules() if isinstance(m, torch.nn.Linear)]
    if not linears:
        return 1024, 1024
    weight = max(linears, key=lambda m: m.weight.numel()).weight
    return int(weight.shape[1]), int(weight.shape[0])


def host_line(layer: tuple[int, int], device, mixed_precision: str) -> str:
    """torch.matmul's best GFLOP/s in fp32 and bf16 on [ROWS x in] x [in x out] of the head's largest `layer`
    (largest_layer: read before the head is wrapped or sharded), and the precision train.mixed_precision runs."""
    k, n = layer
    precision = {"no": "fp32", "bf16": "bf16 (autocast)", "fp16": "fp16 (autocast)"}.get(mixed_precision,
                                                                                         mixed_precision)
    peaks = {dt: matmul_gflops((ROWS, k, n, 1, dt), 3, device) for dt in ("float32", "bfloat16")}
    where = machine() if torch.device(device).type == "cpu" else torch.cuda.get_device_name(device)
    return (f"[train] host: {where}, {torch.get_num_threads()} threads: torch.matmul {peaks['float32']:.0f} GFLOP/s in "
            f"fp32, {peaks['bfloat16']:.0f} in bf16 ([{ROWS} x {k}] x [{k} x {n}], the head's largest layer); this run "
            f"computes in {precision}")


def flagship_training(shipped: Path = SHIPPED) -> Optional[tuple[str, float]]:
    """(name, training tokens) of the shipped flagship head: its recorded train_seconds x tokens_per_s."""
    from selfspec.registry import FLAGSHIP

    for config in sorted(shipped.glob(f"*-{FLAGSHIP}/config.json")):
        training = json.loads(config.read_text()).get("training", {})
        if training.get("train_seconds") and training.get("tokens_per_s"):
            return config.parent.name, training["train_seconds"] * training["tokens_per_s"]
    return None


def rate_line(tokens_per_s: float, steps: int, shipped: Path = SHIPPED) -> Optional[str]:
    """The run's rate so far and the hours the flagship's training would take at it (None where none ships)."""
    flagship = flagship_training(shipped)
    if flagship is None or tokens_per_s <= 0:
        return None
    name, tokens = flagship
    return (f"[train] {tokens_per_s:.0f} training tokens a second over the first {steps} steps: {name}'s last training "
            f"({tokens / 1e6:.2f}M tokens) would take {tokens / tokens_per_s / 3600:.1f} h at this rate")
