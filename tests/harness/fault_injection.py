"""Fault injection: SIGKILL entry points at random moments, run them again, and check that no kill leaves a
corrupt file and that the run they finish equals an uninterrupted reference run.

    python tests/run_harness.py fault_injection [kills=5] [seed=0]
        [entry_points=[train,regenerate,cache_features,export,publish]]

Per entry point, on a tiny target: a reference run (uninterrupted), then `kills` launches of the same command
into another output, each SIGKILLed at a moment drawn from `modes`:

- `random`: uniformly within the reference run's duration (start-up, model loading, computing or writing);
- `write`: while the output is being written (something under the output's folder changed), with every file
  write, fsync and rename of the killed process slowed by `write_pause` seconds so that a kill lands between
  them (a wrapper patches os.replace/os.rename/os.fsync, safetensors' save_file, torch.save, shutil.copyfile).

An entry point that starts over (cache_features, export, publish) is killed alternately into a missing output and
over an earlier complete result (a copy of the reference's): a kill must leave the old result or the new one,
whole. regenerate.py resumes; when a launch of it finishes before its kill, the next round starts afresh.

After each kill, every file the entry point left must parse or load: JSON, every complete JSONL line,
safetensors; a folder it writes (an export, a staged repo, a features cache, a head) must be complete if it
exists. A torn last JSONL line (no newline) is counted apart: regenerate.py drops it on resume by design. Then
one last launch runs to the end, and its result must equal the reference's: byte for byte (regenerate's JSONL,
an export, a staged repo), tensor for tensor (features shards, in index order; index.json up to its timing and
the shards' tagged names; no unlisted shard left), or, for training, the head's weights bit for bit
(tests/harness/kill_resume.py runs that campaign: kills mid-step, mid-checkpoint and during the final save, each
followed by resume=auto).

Prints a summary table (entry point, kills, resumed / restarted, identical to reference, corrupt files,
leftovers) and one JSON line; exits non-zero if a result differs or a file was corrupt.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from harness import kill_resume

ROOT = Path(__file__).resolve().parents[2]  # the checkout (this file is tests/harness/<name>.py)
ENTRY_POINTS = ("train", "regenerate", "cache_features", "export", "publish")
MODES = ("random", "write")
PAUSE_ENV = "SELFSPEC_FAULT_PAUSE"

# Run an entry point with every file write, fsync and rename followed by a pause: a kill can land between them.
SLOW_WRITES = r"""
import functools, os, runpy, shutil, sys, time
import safetensors.torch, torch

pause = float(os.environ["SELFSPEC_FAULT_PAUSE"])

def slow(fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        out = fn(*args, **kwargs)
        time.sleep(pause)
        return out
    return wrapped

slowed = {}
for owner, name in ((os, "replace"), (os, "rename"), (os, "fsync"), (safetensors.torch, "save_file"), (torch, "save"),
                    (shutil, "copyfile")):
    fn = getattr(owner, name)
    slowed[id(fn)] = slow(fn)
    setattr(owner, name, slowed[id(fn)])
# selfspec modules imported before this ran (in a warm Python's child) hold their own references: slow those too
for module_name, module in list(sys.modules.items()):
    if module_name.startswith("selfspec") and module is not None:
        for key, value in list(vars(module).items()):
            if id(value) in slowed:
                setattr(module, key, slowed[id(value)])
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python script` would
runpy.run_path(script, run_name="__main__")
"""


@dataclass
class FaultInjectionConfig:
    """Schema of conf/fault_injection.yaml."""

    entry_points: list[str] = field(default_factory=lambda: list(ENTRY_POINTS), metadata={"help": (
        "entry points to kill (some of: train, regenerate, cache_features, export, publish)")})
    kills: int = field(default=5, metadata={"help": "SIGKILLs per entry point before its last, uninterrupted launch"})
    seed: int = field(default=0, metadata={"help": "seed that draws the kill moments"})
    modes: list[str] = field(default_factory=lambda: list(MODES), metadata={"help": (
        "kill moments to draw from (see the module docstring)")})
    write_pause: float = field(default=0.2, metadata={"help": (
        "seconds every file write / fsync / rename pauses in killed launches (widens the windows a kill lands in)")})
    train_steps: int = field(default=24, metadata={"help": "train: optimizer steps of harness/kill_resume.py's run"})
    save_every: int = field(default=3, metadata={"help": "train: checkpoint interval of harness/kill_resume.py's run"})
    conversations: int = field(default=12, metadata={"help": (
        "regenerate / cache_features: conversations of data=tiny they go through")})
    workers: int = field(default=2, metadata={"help": (
        "entry points run side by side (each launch is a process; keep it at the cores you have)")})
    work_dir: str = field(default="outputs/fault_injection", metadata={"help": (
        "where the reference and the killed runs go (<work_dir>/<entry point>/...); emptied first")})
    launch_timeout: float = field(default=300.0, metadata={"help": (
        "seconds one launch may take before it counts as hung")})


# ---------------------------------------------------------------------------------------------- checks


def _bad_json(path: Path) -> bool:
    try:
        json.loads(path.read_text(encoding="utf-8"))
        return False
    except (ValueError, UnicodeDecodeError):
        return True


def _bad_safetensors(path: Path) -> bool:
    from safetensors.torch import load_file

    try:
        load_file(str(path))
        return False
    except Exception:  # noqa: BLE001 - whatever the reason, the file does not load
        return True


def check_jsonl(path: Path) -> tuple[list[str], int]:
    """(corrupt files, torn tails): a complete line that is not JSON makes the file corrupt; a last line without
    its newline is a torn tail."""
    if not path.exists():
        return [], 0
    *lines, tail = path.read_bytes().split(b"\n")
    for line in lines:
        try:
            json.loads(line)
        except ValueError:
            return [path.name], 0
    return [], int(bool(tail))


def check_folder(folder: Path, required: tuple[str, ...]) -> list[str]:
    """Files of `folder` that do not parse or load, and, if it exists, the required files it lacks (an
    incomplete folder). Hidden files (temp files of writes in progress) are not outputs: never read."""
    if not folder.exists():
        return []
    bad = [f"{folder.name}/{name} (missing)" for name in required if not (folder / name).is_file()]
    for p in sorted(folder.rglob("*")):
        if not p.is_file() or any(part.startswith(".") for part in p.relative_to(folder).parts):
            continue
        if (p.suffix == ".json" and _bad_json(p)) or (p.suffix == ".safetensors" and _bad_safetensors(p)):
            bad.append(str(p.relative_to(folder.parent)))
    return bad


def check_features(folder: Path) -> list[str]:
    """A features cache: every shard loads; an index.json, if there, lists shards that all exist."""
    bad = check_folder(folder, ())
    index = folder / "index.json"
    if index.is_file() and not _bad_json(index):
        listed = [s["file"] for s in json.loads(index.read_text()).get("shards", [])]
        bad += [f"{folder.name}/{f} (listed in index.json, missing)" for f in listed if not (folder / f).is_file()]
    return bad


def leftovers(folder: Path) -> list[str]:
    """Hidden temp files or folders of killed writes still there after the last launch (run locks aside, and the
    owner record core/ownership.py puts in a finished output folder: written inside its temp folder before the swap)."""
    from selfspec.core.ownership import OWNER_FILE

    root = folder.parent
    if not root.exists():
        return []
    return sorted(str(p.relative_to(root)) for p in root.rglob(".*")
                  if not p.name.endswith(".selfspec.lock") and p.name != OWNER_FILE
                  and (p.name.startswith(f".{folder.name}") or folder in p.parents))


def _visible_files(root: Path) -> dict[str, Path]:
    return {str(p.relative_to(root)): p for p in root.rglob("*")
            if p.is_file() and not any(x.startswith(".") for x in p.relative_to(root).parts)}


def same_files(a: Path, b: Path) -> bool:
    """Folders (or files) with the same visible files, byte for byte."""
    if a.is_file() or b.is_file():
        return a.is_file() and b.is_file() and a.read_bytes() == b.read_bytes()
    fa, fb = _visible_files(a), _visible_files(b)
    return fa.keys() == fb.keys() and all(fa[k].read_bytes() == fb[k].read_bytes() for k in fa)


def same_features(a: Path, b: Path) -> bool:
    """Two features caches with the same index (up to its timing and the shards' file names, which carry a
    run's tag) and the same tensors in each shard, in index order; no shard the index does not list."""
    import torch
    from safetensors.torch import load_file

    ia, ib = (json.loads((x / "index.json").read_text()) for x in (a, b))

    def plain(index: dict) -> dict:
        return {**{k: v for k, v in index.items() if k not in ("tokens_per_s", "shards")},
                "shards": [{k: v for k, v in s.items() if k != "file"} for s in index["shards"]]}

    if plain(ia) != plain(ib):
        return False
    for sa, sb in zip(ia["shards"], ib["shards"]):
        ta, tb = load_file(str(a / sa["file"])), load_file(str(b / sb["file"]))
        if ta.keys() != tb.keys() or not all(torch.equal(ta[k], tb[k]) for k in ta):
            return False
    listed = {s["file"] for s in ib["shards"]} | {"index.json", "config.yaml"}
    return set(_visible_files(b)) <= listed


# ---------------------------------------------------------------------------------------------- launching


@dataclass
class Launch:
    """What one launch did."""

    killed: bool = False
    mode: str = "-"
    seconds: float = 0.0
    returncode: Optional[int] = None
    stdout: str = ""
    stderr_tail: str = ""


def _tree_state(root: Path) -> dict[str, tuple[int, int]]:
    if not root.exists():
        return {}
    out = {}
    # os.walk, not rglob: the writer being watched renames and removes its temp folders while this lists them, and
    # os.walk passes over a folder that vanished before it was read (rglob raises FileNotFoundError)
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(folder) / name
            try:
                st = p.stat()
            except FileNotFoundError:  # removed while listing
                continue
            out[str(p)] = (st.st_mtime_ns, st.st_size)
    return out


def launch(cmd: list[str], log: Path, watch: Path, mode: Optional[str] = None, rng: Optional[random.Random] = None,
           horizon: float = 5.0, pause: float = 0.0, timeout: float = 300.0, warm=None) -> Launch:
    """Run `cmd` (a script and its overrides) in a fresh interpreter, or in a child of `warm` (a WarmPython:
    the same process minus the imports); with `mode`, SIGKILL it at a moment of that kind: `random` within
    `horizon` seconds, `write` once something under `watch` changed (a random moment of the write)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("SELFSPEC_DEBUG", None)
    log.parent.mkdir(parents=True, exist_ok=True)
    if mode == "write" and pause > 0:
        env[PAUSE_ENV] = str(pause)
        wrapper = log.parent / "slow_writes.py"  # beside the logs, outside every watched output
        wrapper.write_text(SLOW_WRITES)
        cmd = [str(wrapper), *cmd]
    res = Launch(mode=mode or "-")
    before = _tree_state(watch)
    if warm is None:
        with open(log, "w") as out, open(log.with_suffix(".err"), "w") as err:  # the child holds its own copies
            proc = subprocess.Popen([sys.executable, *cmd], cwd=ROOT, env=env, stdout=out, stderr=err)
    else:
        proc = warm.start(cmd[0], cmd[1:], ROOT, env, log, log.with_suffix(".err"), timeout + 60)
    t0 = time.time()
    fire_at = t0 + rng.uniform(0.2, horizon) if mode == "random" else None
    while proc.poll() is None:
        now = time.time()
        if now - t0 > timeout:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"{' '.join(cmd[:2])} hung for {timeout:.0f} s")
        if mode == "write" and fire_at is None and _tree_state(watch) != before:
            fire_at = now + rng.uniform(0.0, max(2 * pause, 0.05))
        if fire_at is not None and now >= fire_at:
            proc.kill()  # SIGKILL: no handler, no cleanup
            res.killed = True
            break
        time.sleep(0.003)
    proc.wait()
    res.seconds = round(time.time() - t0, 2)
    res.returncode = proc.returncode
    res.stdout = log.read_text(errors="replace")
    res.stderr_tail = log.with_suffix(".err").read_text(errors="replace")[-1500:]
    return res


# ---------------------------------------------------------------------------------------------- entry points


@dataclass
class EntryPoint:
    """How to run one entry point into an output, check what a kill left there, and compare two results."""

    name: str
    command: Callable[[Path], list[str]]  # output path -> script and overrides
    output: str  # the output's name under the run folder (a file or a folder)
    check: Callable[[Path], tuple[list[str], int]]  # output -> (corrupt files, torn tails)
    same: Callable[[Path, Path], bool]  # (reference output, output) -> identical
    resumed: Callable[[str], Optional[bool]] = lambda stdout: False  # from its log: continued earlier work?
    resumes: bool = False  # it continues a killed run's work (else it starts over)
    index: Optional[str] = None  # a file whose presence marks the output complete (else: all its files load)

    def complete(self, out: Path) -> bool:
        """The output is there and whole (what a finished run leaves)."""
        return out.exists() and (self.index is None or (out / self.index).is_file()) and not self.check(out)[0]


def _regenerate_resumed(stdout: str) -> Optional[bool]:
    m = re.search(r"(\d+) already in", stdout)
    return None if m is None else int(m.group(1)) > 0


def entry_points(cfg, head: Path) -> dict[str, EntryPoint]:
    n = cfg.conversations
    return {
        "regenerate": EntryPoint(
            "scripts/regenerate.py",
            lambda out: ["scripts/regenerate.py", "target=tiny-llama", "data=tiny", f"data.max_conversations={n}",
                         "max_new_tokens=8", "max_turns=1", "batch_size=1", f"out={out}"],  # batch 1: batch-invariant
            "regenerated.jsonl", check_jsonl, same_files, _regenerate_resumed, resumes=True),
        "cache_features": EntryPoint(
            "scripts/cache_features.py",
            lambda out: ["scripts/cache_features.py", "target=tiny-llama", "data=tiny", f"data.max_conversations={n}",
                         "shard_tokens=300", f"data.features_dir={out}"],
            "features", lambda out: (check_features(out), 0), same_features, index="index.json"),
        "export": EntryPoint(
            "scripts/export.py",
            lambda out: ["scripts/export.py", f"head={head}", "format=eagle", f"out={out}"],
            "export", lambda out: (check_folder(out, ("config.json", "model.safetensors")), 0), same_files),
        "publish": EntryPoint(
            "scripts/publish.py",
            lambda out: ["scripts/publish.py", f"head={head}", "repo_id=someone/tiny-head", "dry_run=true",
                         f"out={out}"],
            "staged", lambda out: (check_folder(out, ("config.json", "model.safetensors", "README.md")), 0),
            same_files),
    }


@dataclass
class Row:
    """One entry point's campaign, as the summary table shows it."""

    entry_point: str
    kills: int = 0
    over_earlier: int = 0  # launches that started over an earlier complete result
    resumed: int = 0
    restarted: int = 0
    identical: bool = False
    corrupt: list[str] = field(default_factory=list)
    torn_tails: int = 0
    leftovers: list[str] = field(default_factory=list)
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)


def campaign(ep: EntryPoint, work: Path, kills: int, seed: int, modes: list[str], pause: float,
             timeout: float, warm=None) -> Row:
    """Reference run, `kills` killed launches, one last launch (each in a child of `warm`, if given); the row of
    the summary.

    An entry point that starts over (`ep.resumes` false) is killed alternately into a missing output and over an
    earlier complete result (a copy of the reference's, put there when none is): the kill must leave the old
    result or the new one, whole. One that resumes and finishes before its kill came starts a new round on a
    fresh output (its finished result must equal the reference's already)."""
    t0 = time.time()
    row = Row(ep.name)
    shutil.rmtree(work, ignore_errors=True)
    ref_out, out = work / "reference" / ep.output, work / "run" / ep.output
    rng = random.Random(f"{seed}:{ep.name}")
    ref = launch(ep.command(ref_out), work / "logs" / "reference.log", ref_out.parent, timeout=timeout,
                 warm=warm)
    if ref.returncode != 0:
        row.problems.append(f"the reference run failed (exit {ref.returncode}): {ref.stderr_tail[-400:]}")
        return row
    started = False  # a launch before this one already began the output
    for i in range(1, kills + 1):
        mode = rng.choice(modes)
        if not ep.resumes and i % 2 == 0 and not ep.complete(out):
            _copy(ref_out, out)  # an earlier complete result (over what killed launches left), to overwrite
            started = True
        row.over_earlier += not ep.resumes and ep.complete(out)
        res = launch(ep.command(out), work / "logs" / f"kill{i}.log", out.parent, mode, rng, horizon=ref.seconds,
                     pause=pause, timeout=timeout, warm=warm)
        _count_start(row, ep, res, started)
        corrupt, torn = ep.check(out)
        row.corrupt += [f"kill {i} ({mode}): {c}" for c in corrupt]
        row.torn_tails += torn
        started = started or out.exists()
        row.kills += res.killed
        if res.killed:
            continue
        if res.returncode != 0:  # it finished before its kill came, or failed by itself
            row.problems.append(f"launch {i} failed by itself (exit {res.returncode}): {res.stderr_tail[-400:]}")
            break
        if not ep.same(ref_out, out):
            row.problems.append(f"launch {i} (not killed) finished with a result that differs from the reference's")
            break
        if ep.resumes:  # nothing left to do in this output: a new round
            _remove(out)
            started = False
    if not row.problems:
        last = launch(ep.command(out), work / "logs" / "last.log", out.parent, timeout=timeout, warm=warm)
        _count_start(row, ep, last, started)
        corrupt, torn = ep.check(out)
        row.corrupt += [f"last launch: {c}" for c in corrupt]
        if last.returncode != 0:
            row.problems.append(f"the last launch failed (exit {last.returncode}): {last.stderr_tail[-400:]}")
    row.identical = not row.problems and ep.same(ref_out, out)
    if not row.identical and not row.problems:
        row.problems.append(f"the result differs from the reference run's ({out} vs {ref_out})")
    row.leftovers = leftovers(out)
    if row.corrupt:
        row.problems.append(f"corrupt files after a kill: {row.corrupt[:3]}")
    row.seconds = round(time.time() - t0, 1)
    return row


def _copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src, dst, dirs_exist_ok=True) if src.is_dir() else shutil.copy(src, dst)


def _remove(path: Path) -> None:
    shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


def _count_start(row: Row, ep: EntryPoint, res: Launch, started: bool) -> None:
    """A launch after a kill that had left some output: did it continue that work or start over?"""
    if not started:
        return
    resumed = ep.resumed(res.stdout)
    if resumed is None:
        return  # killed before its log said
    row.resumed += resumed
    row.restarted += not resumed


def train_campaign(cfg, work: Path) -> Row:
    """Training through harness/kill_resume.py (kills mid-step, mid-checkpoint, during the final save)."""
    t0 = time.time()
    modes = ["startup", "step", "checkpoint", "final"] if cfg.kills >= 2 else ["checkpoint"]
    result = kill_resume.run_campaign(kills=cfg.kills, seed=cfg.seed, steps=cfg.train_steps,
                                      save_every=cfg.save_every, modes=modes, work_dir=work,
                                      launch_timeout=cfg.launch_timeout, log=lambda *_: None)
    rows = result["rows"]
    after_kill = rows[1:]  # each launch that followed a kill
    row = Row("methods/eagle/train.py", kills=result["kills"], identical=result["identical"],
              resumed=sum(r.start_known and r.resumed_from is not None for r in after_kill),
              restarted=sum(r.start_known and r.resumed_from is None for r in after_kill),
              corrupt=[f"kill {i}: {c}" for i, r in enumerate(rows, 1) for c in r.corrupt],
              leftovers=list(result["leftover_temp_folders"]), problems=list(result["problems"]),
              seconds=round(time.time() - t0, 1))
    return row


def _fixture_head(folder: Path) -> Path:
    """A tiny-llama EAGLE head to export and publish."""
    import torch

    from selfspec.heads.checkpoint import head_record, save_head
    from selfspec.methods.eagle.head import build_eagle
    from selfspec.target.model import load_target

    target = load_target("tiny:llama")
    torch.manual_seed(0)
    head = build_eagle(target.model)
    return save_head(head, folder / "head", head_record(head, target.identity))


def run(cfg) -> list[Row]:
    """Every selected entry point's campaign, `workers` at a time."""
    work = Path(cfg.work_dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    head = _fixture_head(work / "fixtures") if {"export", "publish"} & set(cfg.entry_points) else work
    eps = entry_points(cfg, head)

    def one(name: str) -> Row:
        if name == "train":
            return train_campaign(cfg, work / "train")
        return campaign(eps[name], work / name, cfg.kills, cfg.seed, list(cfg.modes), cfg.write_pause,
                        cfg.launch_timeout)

    with ThreadPoolExecutor(max_workers=max(1, cfg.workers)) as pool:
        return list(pool.map(one, cfg.entry_points))


def table(rows: list[Row]) -> str:
    lines = ["| entry point | kills | launches over an earlier result | resumed / restarted | identical to reference "
             "| corrupt files | torn JSONL tails | leftovers after the end | seconds |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| `{r.entry_point}` | {r.kills} | {r.over_earlier} | {r.resumed} / {r.restarted} | "
                     f"{'yes' if r.identical else '**NO**'} | {len(r.corrupt)} | {r.torn_tails} | "
                     f"{len(r.leftovers)} | {r.seconds:.0f} |")
    return "\n".join(lines)


def _main(cfg) -> dict:
    from selfspec.core.errors import UserError

    unknown = [e for e in cfg.entry_points if e not in ENTRY_POINTS] + [m for m in cfg.modes if m not in MODES]
    if unknown:
        raise UserError(f"unknown entry points or modes {unknown}; entry_points: {list(ENTRY_POINTS)}, "
                        f"modes: {list(MODES)}")
    if cfg.kills < 0 or cfg.write_pause < 0 or not cfg.modes:
        raise UserError("need kills >= 0, write_pause >= 0 and at least one mode")
    t0 = time.time()
    rows = run(cfg)
    print(table(rows))
    for r in rows:
        for p in r.problems:
            print(f"[fault_injection] {r.entry_point}: {p}")
        for left in r.leftovers:
            print(f"[fault_injection] {r.entry_point}: left over after the end: {left}")
    summary = {"kills": {r.entry_point: r.kills for r in rows}, "identical": all(r.identical for r in rows),
               "corrupt_files": sum(len(r.corrupt) for r in rows), "seed": cfg.seed,
               "seconds": round(time.time() - t0, 1)}
    print(json.dumps(summary), flush=True)
    failed = [r.entry_point for r in rows if r.problems]
    if failed:
        raise UserError(f"fault injection failed for {', '.join(failed)} (see the lines above the table's JSON)")
    return summary


def main(argv: Optional[list[str]] = None, prog: Optional[str] = None):
    from harness import entry

    return entry("fault_injection", FaultInjectionConfig)(_main)(argv, prog=prog)
