"""Kill a CPU training run with SIGKILL at random moments, resume it (resume=auto) after every kill, and check
that it ends exactly where an uninterrupted run with the same seed ends.

    python tests/run_harness.py kill_resume kills=10 seed=0 [recipe=methods/eagle/train.py] [steps=36] [save_every=3]

Kill moments (`modes`): `startup` (a random delay after launch), `step` (once training reaches a random step),
`checkpoint` (while a checkpoint is being written: a `.tmp-*` folder exists in <run>/checkpoints/; the run is
started with SELFSPEC_TEST_SAVE_PAUSE so that train/state.save_state pauses half-way through the write) and
`final` (after the last step, while the last checkpoint is written, before the head; always the last kill).
After each kill: every `step_*` folder must load (train.state.load_state), so must `head/` and `ckpt.pt` when
they are there (heads.checkpoint.read_head), and the next launch must resume from the newest complete checkpoint
(its log says where), so only the steps after that checkpoint are recomputed.
At the end the head weights must equal those of an uninterrupted run (fp32, CPU), bit for bit.

Prints a markdown table of the kills, then one JSON line; exits non-zero if any check failed.
"""

from __future__ import annotations

import functools
import json
import os
import random
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]  # the checkout (this file is tests/harness/<name>.py)
STEP_RE = re.compile(r"\|\s*(\d+)/(\d+)\s*\[")  # tqdm: "train:  37%|███▋      | 11/30 [00:03<...]"
RESUMED_RE = re.compile(r"resumed from (\S+) at step (\d+)")
MODES = ("startup", "step", "checkpoint", "final")


@dataclass
class KillResumeConfig:
    """Schema of conf/kill_resume.yaml."""

    kills: int = field(default=10, metadata={"help": (
        "How many SIGKILLs to deliver before letting the run finish, and the seed that picks the kill moments.")})
    seed: int = field(default=0, metadata={"help": "Seed that picks the kill moments."})
    recipe: str = field(default="methods/eagle/train.py", metadata={"help": (
        "The training recipe (a script taking Hydra overrides, output_dir= and resume=auto).")})
    steps: int = field(default=36, metadata={"help": (
        "Optimizer steps of the run, and the checkpoint interval (train.max_steps / train.save_every).")})
    save_every: int = field(default=3, metadata={"help": "Checkpoint interval (train.save_every)."})
    overrides: list[str] = field(default_factory=lambda: [
        "target=tiny-llama", "data=tiny", "data.max_conversations=24", "train.batch_size=2", "train.seed=3",
        "train.warmup_steps=4", "train.eval_every=0", "train.eval_prompts=0", "train.keep_last=2"], metadata={"help": (
        "The rest of the run: a tiny target on little data, batches of 2, so that it spans several epochs.")})
    modes: list[str] = field(default_factory=lambda: list(MODES), metadata={"help": (
        "Kill moments to draw from (see the module docstring); `final`, if listed, is the last kill.")})
    save_pause: float = field(default=0.4, metadata={"help": (
        "Seconds save_state pauses half-way through each checkpoint in the killed runs (SELFSPEC_TEST_SAVE_PAUSE).")})
    work_dir: str = field(default="outputs/kill_resume", metadata={"help": (
        "Where the two runs go (<work_dir>/reference, <work_dir>/interrupted); emptied first.")})
    launch_timeout: float = field(default=600.0, metadata={"help": (
        "Seconds one launch may take before it counts as hung.")})


@dataclass
class Launch:
    """What one launch of the recipe did."""

    killed: bool = False
    mode: str = "-"
    seconds: float = 0.0  # from launch to kill (or exit)
    step_reached: int = 0  # highest step the progress bar showed
    resumed_from: Optional[int] = None  # step of the checkpoint this launch resumed from (None: started fresh)
    start_known: bool = False  # its log said where it started (a kill during start-up can come first)
    returncode: Optional[int] = None
    during_save: bool = False  # a checkpoint was being written (a .tmp-* folder existed) when it was killed
    newest_after: Optional[int] = None  # newest complete checkpoint once it was gone
    corrupt: list = field(default_factory=list)  # step_* folders that did not load
    stderr_tail: str = ""


def _checkpoint_steps(run: Path) -> list[int]:
    from selfspec.train.state import list_checkpoints

    return [int(p.name.split("_")[1]) for p in list_checkpoints(run)]


def _corrupt_checkpoints(run: Path) -> list[str]:
    """The `step_*` folders that do not load, and the exported head folder / ckpt.pt if one is there and does not
    load (a kill during the final save must leave the old one or the new one, never half of one)."""
    from selfspec.heads.checkpoint import read_head
    from selfspec.core.errors import UserError
    from selfspec.train.state import list_checkpoints, load_state

    bad = []
    for folder in list_checkpoints(run):
        try:
            load_state(folder)
        except UserError:
            bad.append(folder.name)
    for export in (run / "head", run / "ckpt.pt"):
        if export.exists():
            try:
                read_head(str(export))
            except UserError:
                bad.append(export.name)
    return bad


def _temp_folders(run: Path) -> set[str]:
    root = run / "checkpoints"
    return {p.name for p in root.iterdir() if p.name.startswith(".tmp-")} if root.exists() else set()


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()
    except FileNotFoundError:  # the child has not opened it yet
        return []


def launch(recipe: str, overrides: list[str], run: Path, env: dict, mode: Optional[str] = None,
           rng: Optional[random.Random] = None, after_step: int = 0, total: int = 0, save_pause: float = 0.0,
           timeout: float = 600.0, warm=None) -> Launch:
    """Start the recipe, in a fresh interpreter or in a child of `warm` (a WarmPython: the same process minus the
    imports, its output in files beside the run); with `mode`, SIGKILL it at a moment of that kind (drawn from
    `rng`) past `after_step`."""
    args = [*overrides, f"output_dir={run}", "resume=auto"]
    readers: list[threading.Thread] = []
    if warm is None:
        proc = subprocess.Popen([sys.executable, recipe, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        out_lines: list[str] = []
        err_lines: list[str] = []
        readers = [threading.Thread(target=lambda s=s, d=d: d.extend(line.rstrip("\n") for line in s), daemon=True)
                   for s, d in ((proc.stdout, out_lines), (proc.stderr, err_lines))]
        for t in readers:
            t.start()
        out_now, err_now = (lambda: list(out_lines)), (lambda: list(err_lines))
    else:
        logs = run.parent / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        n = len(list(logs.glob("*.out")))
        out_path, err_path = logs / f"launch{n}.out", logs / f"launch{n}.err"
        proc = warm.start(recipe, args, ROOT, env, out_path, err_path, timeout + 60)
        out_now, err_now = (lambda: _lines(out_path)), (lambda: _lines(err_path))
    res = Launch(mode=mode or "-")
    stale = _temp_folders(run)  # left by an earlier kill (the next save removes them): not a save in progress

    def saving() -> bool:
        return bool(_temp_folders(run) - stale)

    t0 = time.time()
    deadline = t0 + timeout

    def reached() -> int:
        steps = [int(m.group(1)) for line in err_now()[-50:] for m in [STEP_RE.search(line)] if m]
        return max(steps + [res.step_reached])

    # the moment to kill, by mode
    delay = rng.uniform(0.5, 4.0) if mode == "startup" else 0.0
    target_step = (after_step + rng.randint(1, max(1, (total - after_step) // 2)) if mode in ("step", "checkpoint")
                   else 0)
    fire_at: Optional[float] = None
    while proc.poll() is None:
        now = time.time()
        if now > deadline:
            proc.kill()
            raise RuntimeError(f"{recipe} hung for {timeout:.0f} s")
        res.step_reached = reached()
        if mode is not None and fire_at is None:
            if mode == "startup" and now - t0 >= delay:
                fire_at = now
            elif mode == "step" and res.step_reached >= target_step:
                fire_at = now + rng.uniform(0.0, 0.1)
            elif mode == "checkpoint" and res.step_reached >= target_step and saving():
                fire_at = now + rng.uniform(0.0, save_pause * 0.8)
            elif mode == "final" and any("head sha256" in line for line in out_now()):
                # inside the last checkpoint's write, which pauses save_pause s half-way (a later moment can fall
                # after every write: a fresh interpreter is then in its teardown, a warm child gone)
                fire_at = now + rng.uniform(0.0, save_pause)
        if fire_at is not None and now >= fire_at:
            proc.kill()  # SIGKILL: no handler, no cleanup
            res.killed, res.during_save = True, saving()
            break
        time.sleep(0.005)
    res.seconds = round(time.time() - t0, 2)
    proc.wait()
    for t in readers:
        t.join(timeout=5)
    res.returncode = proc.returncode
    res.step_reached = reached()
    for line in out_now():
        m = RESUMED_RE.search(line)
        if m:
            res.resumed_from, res.start_known = int(m.group(2)), True
        elif "starting fresh" in line:
            res.start_known = True
    res.stderr_tail = "\n".join(err_now()[-5:])[-2000:]
    return res


def _head_weights(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run / "head" / "model.safetensors"))


def run_campaign(kills: int = 10, seed: int = 0, recipe: str = "methods/eagle/train.py", steps: int = 36,
                 save_every: int = 3,
                 overrides: Optional[list[str]] = None, modes=MODES, save_pause: float = 0.4,
                 work_dir: str | Path = "outputs/kill_resume", launch_timeout: float = 600.0, log=print,
                 warm: bool = False) -> dict:
    """Reference run, then the killed-and-resumed run; -> {"rows": [...], "identical": bool, "problems": [...]}.
    `warm`: every launch a child of one warm Python (harness/warm_python.py) started with the launches' environment
    (tqdm reads its TQDM_* variables at import), instead of a fresh interpreter each."""
    overrides = list(overrides if overrides is not None else KillResumeConfig().overrides)
    overrides += [f"train.max_steps={steps}", f"train.save_every={save_every}"]
    env = {**os.environ, "TQDM_MININTERVAL": "0", "TQDM_MINITERS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("SELFSPEC_TEST_SAVE_PAUSE", None)
    python = None
    if warm:
        from harness.warm_python import WarmPython

        python = WarmPython(env)
    try:
        return _campaign(kills, seed, recipe, steps, save_every, overrides, modes, save_pause, Path(work_dir),
                         launch_timeout, log, env, functools.partial(launch, warm=python))
    finally:
        if python is not None:
            python.close()


def _campaign(kills, seed, recipe, steps, save_every, overrides, modes, save_pause, work, launch_timeout, log, env,
              launch) -> dict:
    import torch

    shutil.rmtree(work, ignore_errors=True)
    ref_dir, run_dir = work / "reference", work / "interrupted"
    rng = random.Random(seed)
    problems: list[str] = []

    log(f"[kill_resume] reference: {recipe} {' '.join(overrides)} (uninterrupted)")
    ref = launch(recipe, overrides, ref_dir, env, timeout=launch_timeout)
    if ref.returncode != 0:
        raise RuntimeError(f"the reference run failed (exit {ref.returncode}): {ref.stderr_tail}")

    killed_env = {**env, "SELFSPEC_TEST_SAVE_PAUSE": str(save_pause)}
    plain = [m for m in modes if m != "final"]
    plan = [rng.choice(plain) for _ in range(kills - ("final" in modes))] if plain else []
    if "final" in modes:
        plan.append("final")
    rows: list[Launch] = []
    previous: Optional[Launch] = None  # the last launch that trained (reached a step)
    newest = None
    for i, mode in enumerate(plan, 1):
        after = max(_checkpoint_steps(run_dir) or [0])
        if mode != "final" and after + 2 > steps:
            mode = "startup"  # too close to the end for a kill inside the loop
        res = launch(recipe, overrides, run_dir, killed_env, mode, rng, after, steps, save_pause, launch_timeout)
        _check_resume(res, newest, previous, save_every, problems, i)
        res.corrupt = _corrupt_checkpoints(run_dir)
        found = _checkpoint_steps(run_dir)
        res.newest_after = found[-1] if found else None
        newest = res.newest_after
        if res.step_reached > 0:
            previous = res
        rows.append(res)
        if res.corrupt:
            problems.append(f"kill {i}: corrupt checkpoints {res.corrupt}")
        if not res.killed:
            if res.returncode == 0:
                log(f"[kill_resume] launch {i} finished before its {mode} kill came")
                break
            problems.append(f"launch {i} failed by itself (exit {res.returncode}): {res.stderr_tail}")
            break
        log(f"[kill_resume] kill {i}/{len(plan)} ({mode}) at {res.seconds:.1f} s, step {res.step_reached}; "
            f"newest checkpoint: {res.newest_after}")
    if not rows or rows[-1].killed:  # resume once more, to the end
        last = launch(recipe, overrides, run_dir, env, timeout=launch_timeout)
        _check_resume(last, newest, previous, save_every, problems, len(rows) + 1)
        last.corrupt = _corrupt_checkpoints(run_dir)
        rows.append(last)
        if last.returncode != 0:
            problems.append(f"the final resume failed (exit {last.returncode}): {last.stderr_tail}")
    identical = False
    if not problems:
        a, b = _head_weights(ref_dir), _head_weights(run_dir)
        identical = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        if not identical:
            differ = [k for k in a if k not in b or not torch.equal(a[k], b[k])]
            problems.append(f"final head weights differ from the uninterrupted run: {differ[:4]}")
    leftovers = [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")] \
        if (run_dir / "checkpoints").exists() else []
    return {"rows": rows, "identical": identical, "problems": problems, "kills": sum(r.killed for r in rows),
            "leftover_temp_folders": leftovers, "reference_seconds": ref.seconds}


def _check_resume(res: Launch, newest: Optional[int], previous: Optional[Launch], save_every: int,
                  problems: list[str], i: int) -> None:
    """The launch must resume from the newest complete checkpoint the previous kill left (or start fresh when
    there was none), so that only the steps after it are recomputed."""
    if previous is None or not res.start_known:  # nothing trained yet, or killed before its log said
        return
    if res.resumed_from != newest:
        problems.append(f"launch {i} resumed from step {res.resumed_from}, not from the newest complete "
                        f"checkpoint (step {newest})")
    lost = previous.step_reached - (res.resumed_from or 0)
    if lost > save_every:
        problems.append(f"launch {i} recomputes {lost} steps (> save_every={save_every})")


def table(result: dict) -> str:
    lines = ["| # | kill moment | killed at (s) | step reached | newest complete checkpoint | next run resumed from "
             "| steps recomputed | every step_*, head/, ckpt.pt loads |",
             "|---|---|---|---|---|---|---|---|"]
    rows = result["rows"]
    for i, r in enumerate(rows):
        nxt = rows[i + 1] if i + 1 < len(rows) else None
        told = next((n for n in rows[i + 1:] if n.start_known), None)  # the next launch whose log said where
        if nxt is None or told is None:
            resumed = recomputed = "-"
        else:
            resumed = "start (fresh)" if told.resumed_from is None else f"step {told.resumed_from}"
            if told is not nxt:
                resumed += f" (launch {rows.index(told) + 1}; launch {i + 2} was killed before it said)"
            recomputed = str(max(0, r.step_reached - (told.resumed_from or 0))) if r.step_reached else "0"
        what = (r.mode + (" (mid-checkpoint)" if r.during_save else "")) if r.killed else "(ran to the end)"
        newest = "-" if r.newest_after is None else f"step {r.newest_after}"
        lines.append(f"| {i + 1} | {what} | {r.seconds:.1f} | {r.step_reached} | {newest} | {resumed} | {recomputed} "
                     f"| {'yes' if not r.corrupt else 'NO: ' + ', '.join(r.corrupt)} |")
    return "\n".join(lines)


def _main(cfg) -> dict:
    from selfspec.core.errors import UserError

    if cfg.kills < 0 or cfg.steps < 2 or cfg.save_every < 1:
        raise UserError("need kills >= 0, steps >= 2 and save_every >= 1")
    unknown = [m for m in cfg.modes if m not in MODES]
    if unknown:
        raise UserError(f"unknown kill modes {unknown}; use some of {list(MODES)}")
    if not (ROOT / cfg.recipe).is_file():
        raise UserError(f"recipe '{cfg.recipe}' not found under {ROOT}")
    t0 = time.time()
    result = run_campaign(cfg.kills, cfg.seed, cfg.recipe, cfg.steps, cfg.save_every, list(cfg.overrides),
                          list(cfg.modes), cfg.save_pause, cfg.work_dir, cfg.launch_timeout)
    print(table(result))
    print(f"final head identical to the uninterrupted run: {'yes' if result['identical'] else 'NO'}; "
          f"{result['kills']} kills; leftover temp folders: {len(result['leftover_temp_folders'])}")
    summary = {"kills": result["kills"], "identical": result["identical"], "problems": result["problems"],
               "seconds": round(time.time() - t0, 1), "seed": cfg.seed}
    print(json.dumps(summary), flush=True)
    if result["problems"]:
        raise UserError(f"kill-and-resume failed: {result['problems'][0]}")
    return summary


def main(argv: Optional[list[str]] = None, prog: Optional[str] = None):
    from harness import entry

    return entry("kill_resume", KillResumeConfig)(_main)(argv, prog=prog)
