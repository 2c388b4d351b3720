"""Decoding and training beside another CPU job: each method's speed alone and beside a job of `job_threads` torch
threads doing matmuls in a loop (what any other model, a test run or a browser does to a shared machine), with
torch's threads governed (core/threads.py, the default) and fixed (SELFSPEC_THREADS=fixed: what decoding did
before). Prints one table: tok/s (decode) or s/step (training) alone and beside, the ratio, and the governor's
thread changes.

    python scripts/contention.py [methods=[plain,<head types>...,hybrid,train]] [max_new_tokens=64]

A head type's row (any that drafts beside a lookup, registry `hybrid`) drafts with its shipped head
(heads/pretrained/smollm2-135m-<type>) where one ships, else with an untrained head of the target's shape (its speed,
not its tau, is what this measures: P-EAGLE, DSpark); hybrid is `hybrid_head`'s type beside the suffix lookup; train
is that type's recipe with its demo experiment (experiment=demo_<type>) for a few steps (its steady seconds per step).
Run it alone on the machine: the "alone" rows are the baseline.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from selfspec.core.cli import entry
from selfspec.core.errors import UserError
from selfspec.engines.bench import compared
from selfspec.registry import FLAGSHIP
from selfspec.registry import method as registered
from selfspec.target.model import TargetConfig, load_target_from_config

SHIPPED = Path(__file__).resolve().parents[1] / "heads" / "pretrained"  # smollm2-135m-<type>: the heads that ship
PROMPTS = ["Explain what a hash table is and why lookups are fast on average.",
           "Write a Python function that merges two sorted lists."]
# OpenMP's wait knobs, kept from the job beside (_Job): libgomp's and Intel OpenMP's
WAIT_KNOBS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "OMP_NUM_THREADS")
# the other job: a loop of matmuls on its own threads, until killed
JOB = ("import sys, torch\ntorch.set_num_threads(int(sys.argv[1]))\na = torch.randn(512, 512)\n"
       "print('ready', flush=True)\nwhile True:\n    a = torch.tanh(a @ a)\n")


@dataclass
class ContentionConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    methods: list[str] = field(default_factory=lambda: ["plain", *compared(), "hybrid", "train"], metadata={
        "help": "plain, hybrid, train or any head type that drafts beside a lookup (conf/contention.yaml: a few)"})
    hybrid_head: str = field(default=FLAGSHIP, metadata={"help": (
        "the head type of the hybrid row (its shipped head) and of the train row (its recipe's demo experiment)")})
    max_new_tokens: int = field(default=64, metadata={"help": "greedy tokens per prompt"})
    job_threads: int = field(default=2, metadata={"help": "threads of the job beside"})
    train_steps: int = field(default=12, metadata={"help": "training steps timed (the first 5 are warm-up)"})
    alone_pairs: int = field(default=0, metadata={"help": (
        "Also time each method alone governed and with fixed threads in turn this many times (paired: the machine's "
        "drift cancels) and print the median of the pairs' ratios, what the governor costs alone (0 = skip)")})


def _head(target, kind: str):
    """The shipped head of this type (a folder), else an untrained one of the target's shape (vocabulary 8192)."""
    shipped = SHIPPED / f"smollm2-135m-{kind}"
    if shipped.is_dir():
        return str(shipped)
    print(f"[contention] {kind}: no shipped head, an untrained one of the target's shape", flush=True)
    torch.manual_seed(0)
    return registered(kind).load("head")(target.model, vocab_size=8192, draft_vocab=torch.arange(8192),
                                         tokenizer=target.tokenizer)


def _decode(target, method: str, n: int, hybrid_head: str = FLAGSHIP) -> float:
    """tok/s of `method` over PROMPTS (one warm-up generation first)."""
    from selfspec.decode.drafters import build_drafter
    from selfspec.decode.engine import generate, stop_token_ids
    from selfspec.target.model import chat_prompt_ids

    if method == "plain":
        drafter = None
    elif method == "hybrid":
        drafter = build_drafter("hybrid", target, head=str(SHIPPED / f"smollm2-135m-{hybrid_head}"))
    else:
        drafter = build_drafter(method, target, head=_head(target, method))
    eos = stop_token_ids(target)
    ids = [chat_prompt_ids(target.tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    generate(target, drafter, ids[0], 8, eos_token_ids=eos)
    tokens, seconds = 0, 0.0
    for p in ids:
        r = generate(target, drafter, p, n, eos_token_ids=eos)
        tokens, seconds = tokens + r.new_tokens, seconds + r.total_s
    return tokens / seconds


def _train_step_s(steps: int, env: dict, kind: str = FLAGSHIP) -> float:
    """Steady seconds per step of a head type's demo recipe (a fresh process, as a user launches it)."""
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", registered(kind).recipe, f"experiment=demo_{kind}", f"train.max_steps={steps}",
               "train.eval_every=0", "train.save_every=0", "train.eval_prompts=0", f"output_dir={d}/run"]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise UserError(f"the training probe failed: {proc.stderr.strip().splitlines()[-1:]}")
        training = json.loads((Path(d) / "run" / "head" / "config.json").read_text())["training"]
        return training.get("steady_step_s") or training["train_seconds"] / training["steps"]


def job_env(env) -> dict[str, str]:
    """The job's environment: a default torch job whatever this process is run with. A wait policy set for the
    measured method (OMP_WAIT_POLICY=PASSIVE, GOMP_SPINCOUNT) would make the job yield the CPU too and flatter the
    method: a training step measured 0.51x beside a job that inherited GOMP_SPINCOUNT=10000, 0.38x beside a default
    one (2026-11-29)."""
    return {k: v for k, v in env.items() if k not in WAIT_KNOBS}


class _Job:
    """The other job, started and stopped around a measurement."""

    def __init__(self, threads: int):
        self.threads = threads

    def __enter__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", JOB, str(self.threads)], stdout=subprocess.PIPE, text=True,
                                     env=job_env(os.environ))
        self.proc.stdout.readline()
        time.sleep(1.0)  # its threads at full speed before we measure
        return self

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()


def _govern(governed: bool):
    """Decoding (this process) and training (the probe's, through the environment) governed or at fixed threads."""
    os.environ["SELFSPEC_THREADS"] = "adaptive" if governed else "fixed"
    from selfspec.core import threads

    threads._GOVERNOR = None  # re-read SELFSPEC_THREADS
    return threads


def _speed(cfg, target, method: str) -> float:
    """One measurement: s/step (train) or tok/s."""
    if method == "train":
        return _train_step_s(cfg.train_steps, dict(os.environ), cfg.hybrid_head)
    return _decode(target, method, cfg.max_new_tokens, cfg.hybrid_head)


def _ratio(method: str, a: float, b: float) -> float:
    """How fast measurement `a` ran against `b` (> 1: faster), whichever way the method's unit runs (s/step)."""
    return b / a if method == "train" else a / b


def alone_pairs(cfg, target, method: str) -> dict[str, Any]:
    """Governed against fixed threads alone, in turn `alone_pairs` times: each pair's speed ratio (> 1: the governed
    run was faster), their median, min and max."""
    ratios = []
    for _ in range(cfg.alone_pairs):
        _govern(True)
        governed = _speed(cfg, target, method)
        _govern(False)
        ratios.append(_ratio(method, governed, _speed(cfg, target, method)))
    return {"pairs": len(ratios), "median": round(statistics.median(ratios), 3), "min": round(min(ratios), 3),
            "max": round(max(ratios), 3)}


def measure(cfg, target, method: str, governed: bool) -> dict[str, Any]:
    threads = _govern(governed)
    row: dict[str, Any] = {}
    for where in ("alone", "beside"):
        job = _Job(cfg.job_threads) if where == "beside" else None
        if job is not None:
            job.__enter__()
        try:
            row[where] = round(_speed(cfg, target, method), 3 if method == "train" else 2)
        finally:
            if job is not None:
                job.__exit__()
    row["ratio"] = round(_ratio(method, row["beside"], row["alone"]), 3)
    row["thread_changes"] = threads.governor().changes if method != "train" else None
    return row


@entry("contention", ContentionConfig)
def main(cfg) -> dict:
    bad = [m for m in cfg.methods if m not in ("plain", "hybrid", "train", *compared())]
    if bad:
        raise UserError(f"methods {bad}: each must be plain, hybrid, train or a head type ({', '.join(compared())})")
    if not (SHIPPED / f"smollm2-135m-{cfg.hybrid_head}").is_dir() or not registered(cfg.hybrid_head).recipe:
        raise UserError(f"hybrid_head={cfg.hybrid_head}: no shipped head of that type in {SHIPPED}")
    if cfg.max_new_tokens < 1 or cfg.job_threads < 1 or cfg.train_steps < 6 or cfg.alone_pairs < 0:
        raise UserError("max_new_tokens and job_threads must be >= 1, train_steps >= 6, alone_pairs >= 0")
    from selfspec.core.threads import machine

    target = load_target_from_config(cfg.target)
    print(f"[contention] {machine()}; torch threads {torch.get_num_threads()}; a job of {cfg.job_threads} threads "
          f"beside", flush=True)
    report = {"machine": machine(), "rows": {}}
    for method in cfg.methods:
        for governed in (True, False):
            key = f"{method} ({'governed' if governed else 'fixed threads'})"
            report["rows"][key] = r = measure(cfg, target, method, governed)
            unit = "s/step" if method == "train" else "tok/s"
            print(f"[contention] {key}: alone {r['alone']} {unit}, beside {r['beside']} {unit}, "
                  f"{r['ratio']:.2f}x of alone", flush=True)
    if cfg.alone_pairs:
        report["alone_pairs"] = {}
        for method in cfg.methods:
            report["alone_pairs"][method] = p = alone_pairs(cfg, target, method)
            print(f"[contention] {method} alone, governed / fixed threads over {p['pairs']} pairs: median "
                  f"{p['median']:.3f} (min {p['min']:.3f}, max {p['max']:.3f})", flush=True)
    print("| method | threads | alone | beside | beside / alone |\n|---|---|---|---|---|")
    for key, r in report["rows"].items():
        method, how = key.split(" (")
        print(f"| {method} | {how.rstrip(')')} | {r['alone']} | {r['beside']} | {r['ratio']:.2f}x |")
    if cfg.alone_pairs:
        print("\n| method | alone, governed / fixed threads (median of pairs) | min | max |\n|---|---|---|---|")
        for method, p in report["alone_pairs"].items():
            print(f"| {method} | {p['median']:.3f} | {p['min']:.3f} | {p['max']:.3f} |")
    return report


if __name__ == "__main__":
    main()
