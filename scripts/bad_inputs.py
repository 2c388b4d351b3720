"""The bad-input matrix: every entry point, run as a real subprocess on tiny targets, against inputs a user gets
wrong (missing/truncated/corrupt/foreign/malicious checkpoints, heads for another target, mistyped keys, wrong
types, empty/malformed/truncated/non-UTF-8 data, prompts longer than the context, bad counts, an unwritable
output path, a disk that fills up while a checkpoint is written).

    python scripts/bad_inputs.py [only=[g_,t_]] [workers=2] [output_file=bad_inputs.md]

The contract each case checks (tests/reliability/test_bad_inputs.py runs the same CASES): a non-zero exit; the
last non-empty stderr line is ONE line `error: ...` naming the problem (it contains the case's `expect`) and
what to do; no Python traceback (unless SELFSPEC_DEBUG=1); no file created or changed anywhere under the
case's folders (no head, output file or checkpoint left behind; a malicious pickle's payload never ran).
Prints the matrix as a markdown table (entry point, bad input, exit code, the message).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
PWNED = "PWNED"  # the file a malicious pickle's payload would create in the fixtures folder


@dataclass
class Case:
    id: str
    script: str  # entry point, relative to the repo root
    what: str  # the bad input, in words (the table's column)
    args: Callable[[Path, Path], list[str]]  # (fixtures folder, this case's output folder) -> CLI overrides
    expect: str  # the error line must contain this (case-insensitive)
    setup: Optional[Callable[[Path, Path], None]] = None  # prepare this case's output folder (e.g. a checkpoint)
    disk_full: bool = False  # run with file writers that fail with ENOSPC after writing a few bytes


# Common overrides per entry point: tiny targets, little data, few steps.
TRAIN = ["target=tiny-llama", "data=tiny", "data.max_conversations=12", "train.max_steps=2", "train.eval_every=0",
         "train.eval_prompts=0"]
GEN = ["target=tiny-llama", "max_new_tokens=4"]
BENCH = ["target=tiny-llama", "max_new_tokens=4", "max_prompts=1", "warmup=0", "sweep_k=[]", "methods=[target]"]
DATA = ["target=tiny-llama", "data=jsonl"]
REGEN = ["target=tiny-llama", "data=tiny", "data.max_conversations=2", "max_new_tokens=4"]


def _train(*extra):
    return lambda fx, out: TRAIN + [f"output_dir={out / 'run'}", *[e.format(fx=fx, out=out) for e in extra]]


def _gen(*extra):
    return lambda fx, out: GEN + [e.format(fx=fx, out=out) for e in extra]


def _bench(*extra):
    return lambda fx, out: BENCH + [f"output_file={out / 'bench.json'}", *[e.format(fx=fx, out=out) for e in extra]]


def _data(*extra):
    return lambda fx, out: DATA + [e.format(fx=fx, out=out) for e in extra]


def _regen(*extra):
    return lambda fx, out: REGEN + [e.format(fx=fx, out=out) for e in extra]


def _with_checkpoint(name: str):
    """Put fixture checkpoint `name` into this case's run folder, as a previous run would have left it."""

    def setup(fx: Path, out: Path) -> None:
        dst = out / "run" / "checkpoints"
        dst.mkdir(parents=True)
        shutil.copytree(fx / name, dst / "step_00000001")

    return setup


def _copy(name: str, to: str):
    def setup(fx: Path, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(fx / name, out / to)

    return setup


CASES: list[Case] = [
    # ------------------------------------------------------------------ train/eagle.py
    Case("t_unknown_key", "train/eagle.py", "mistyped config key `train.lrr=1`", _train("train.lrr=1"),
         "unknown config key 'train.lrr'"),
    Case("t_wrong_type", "train/eagle.py", "wrong type `train.max_steps=abc`", _train("train.max_steps=abc"),
         "train.max_steps=abc"),
    Case("t_negative_steps", "train/eagle.py", "`train.max_steps=-1`", _train("train.max_steps=-1"),
         "train.max_steps must be >= 1"),
    Case("t_zero_batch", "train/eagle.py", "`train.batch_size=0`", _train("train.batch_size=0"),
         "train.batch_size must be >= 1"),
    Case("t_unknown_group", "train/eagle.py", "unknown config option `target=tiny-nope`", _train("target=tiny-nope"),
         "Could not find 'target/tiny-nope'"),
    Case("t_missing_data", "train/eagle.py", "dataset file missing", _train("data=jsonl", "data.path={fx}/nope.jsonl"),
         "does not exist"),
    Case("t_empty_data", "train/eagle.py", "empty dataset file", _train("data=jsonl", "data.path={fx}/empty.jsonl"),
         "is empty"),
    Case("t_malformed_data", "train/eagle.py", "malformed JSONL dataset",
         _train("data=jsonl", "data.path={fx}/malformed.jsonl"), "malformed JSON"),
    Case("t_truncated_data", "train/eagle.py", "truncated JSONL dataset (last line cut)",
         _train("data=jsonl", "data.path={fx}/truncated.jsonl"), "truncated.jsonl:2: malformed JSON"),
    Case("t_non_utf8_data", "train/eagle.py", "non-UTF-8 dataset", _train("data=jsonl", "data.path={fx}/latin1.jsonl"),
         "not UTF-8"),
    Case("t_no_assistant", "train/eagle.py", "conversations without an assistant turn",
         _train("data=jsonl", "data.path={fx}/no_assistant.jsonl"), "no_assistant_turn"),
    Case("t_corrupt_resume", "train/eagle.py", "corrupt resume checkpoint (garbage head.safetensors)", _train(),
         "is unreadable", setup=_with_checkpoint("ckpt_corrupt")),
    Case("t_malicious_resume", "train/eagle.py", "resume checkpoint whose trainer.pt holds a malicious pickle",
         _train(), "is unreadable", setup=_with_checkpoint("ckpt_evil")),
    Case("t_foreign_resume", "train/eagle.py", "resume checkpoint of another target (tiny-qwen2 run)", _train(),
         "does not fit this run's head", setup=_with_checkpoint("ckpt_qwen2")),
    Case("t_unwritable_output", "train/eagle.py", "output_dir under a regular file",
         lambda fx, out: TRAIN + [f"output_dir={fx}/a_file/run"], "a file is in the way"),
    Case("t_disk_full", "train/eagle.py", "disk full while writing a checkpoint (ENOSPC)", _train("train.save_every=1"),
         "No space left on device", disk_full=True),
    # ------------------------------------------------------------------ train/eagle3.py
    Case("e3_unknown_key", "train/eagle3.py", "mistyped config key `draft.vocab_sizee=4`",
         _train("draft.vocab_sizee=4"), "unknown config key 'draft.vocab_sizee'"),
    Case("e3_ttt_zero", "train/eagle3.py", "`ttt.steps=0`", _train("ttt.steps=0"), "ttt.steps must be >= 1"),
    Case("e3_init_truncated", "train/eagle3.py", "draft.init_from: truncated head file",
         _train("draft.init_from={fx}/truncated.safetensors"), "corrupt or truncated"),
    Case("e3_init_other_target", "train/eagle3.py", "draft.init_from: head for another target",
         _train("draft.init_from={fx}/head_qwen2"), "is for target 'tiny:qwen2'"),
    # ------------------------------------------------------------------ train/layerskip.py (when present)
    Case("ls_unknown_key", "train/layerskip.py", "mistyped config key `draft.exit_layr=1`",
         _train("draft.exit_layr=1"), "unknown config key 'draft.exit_layr'"),
    Case("ls_bad_exit", "train/layerskip.py", "`draft.exit_layer=99` (the target has 2 layers)",
         _train("draft.exit_layer=99"), "exit_layer=99"),
    # ------------------------------------------------------------------ decode/generate.py
    Case("g_missing_head", "decode/generate.py", "head checkpoint missing", _gen("prompt=hi", "head={fx}/nope"),
         "not found"),
    Case("g_truncated_head", "decode/generate.py", "truncated head (.safetensors cut in half)",
         _gen("prompt=hi", "head={fx}/truncated.safetensors"), "corrupt or truncated"),
    Case("g_corrupt_head", "decode/generate.py", "corrupt head folder (garbage model.safetensors)",
         _gen("prompt=hi", "head={fx}/head_corrupt"), "corrupt or truncated"),
    Case("g_foreign_safetensors", "decode/generate.py", "foreign .safetensors (no selfspec config)",
         _gen("prompt=hi", "head={fx}/foreign.safetensors"), "without a selfspec head config"),
    Case("g_foreign_pt", "decode/generate.py", "foreign .pt (a plain state dict)",
         _gen("prompt=hi", "head={fx}/foreign.pt"), "not a selfspec head checkpoint"),
    Case("g_malicious_pt", "decode/generate.py", "head .pt holding a malicious pickle",
         _gen("prompt=hi", "head={fx}/evil.pt"), "refused, nothing in it was run"),
    Case("g_other_target_head", "decode/generate.py", "head trained for another target",
         _gen("prompt=hi", "head={fx}/head_qwen2"), "is for target 'tiny:qwen2'"),
    Case("g_future_head", "decode/generate.py", "head of a newer checkpoint format",
         _gen("prompt=hi", "head={fx}/head_future"), "format version 99"),
    Case("g_prompt_too_long", "decode/generate.py", "prompt longer than the context (512)",
         _gen("drafter=none", "prompt=" + "x" * 600), "exceeds the target's context"),
    Case("g_zero_new", "decode/generate.py", "`max_new_tokens=0`", _gen("drafter=none", "prompt=hi", "max_new_tokens=0"),
         "max_new_tokens must be > 0"),
    Case("g_negative_new", "decode/generate.py", "`max_new_tokens=-3`",
         _gen("drafter=none", "prompt=hi", "max_new_tokens=-3"), "max_new_tokens must be > 0"),
    Case("g_malformed_prompts", "decode/generate.py", "malformed prompts file",
         _gen("drafter=none", "prompts_file={fx}/malformed_prompts.jsonl", "output_file={out}/o.jsonl"),
         "is not valid JSON"),
    Case("g_non_utf8_prompts", "decode/generate.py", "non-UTF-8 prompts file",
         _gen("drafter=none", "prompts_file={fx}/latin1_prompts.jsonl", "output_file={out}/o.jsonl"), "not UTF-8"),
    Case("g_second_prompt_too_long", "decode/generate.py", "prompts file whose 2nd prompt is longer than the context",
         _gen("drafter=none", "prompts_file={fx}/long_second.jsonl", "output_file={out}/o.jsonl"),
         "prompt 2 ("),
    Case("g_unwritable_output", "decode/generate.py", "output_file under a regular file",
         _gen("drafter=none", "prompt=hi", "output_file={fx}/a_file/o.jsonl"), "a file is in the way"),
    # ------------------------------------------------------------------ scripts/bench.py
    Case("b_missing_head", "scripts/bench.py", "head checkpoint missing", _bench("methods=[eagle]", "head={fx}/nope"),
         "not found"),
    Case("b_malformed_prompts", "scripts/bench.py", "malformed prompts file",
         _bench("prompts_file={fx}/malformed_prompts.jsonl"), "is not valid JSON"),
    Case("b_unknown_method", "scripts/bench.py", "unknown method `methods=[nope]`", _bench("methods=[nope]"),
         "unknown bench method 'nope'"),
    Case("b_unwritable_output", "scripts/bench.py", "output_file under a regular file",
         lambda fx, out: BENCH + [f"output_file={fx}/a_file/bench.json"], "cannot create the folder"),
    # ------------------------------------------------------------------ scripts/data_stats.py
    Case("d_empty", "scripts/data_stats.py", "empty dataset file", _data("data.path={fx}/empty.jsonl"), "is empty"),
    Case("d_non_utf8", "scripts/data_stats.py", "non-UTF-8 dataset", _data("data.path={fx}/latin1.jsonl"),
         "not UTF-8"),
    Case("d_truncated_array", "scripts/data_stats.py", "JSON array cut inside its only record",
         _data("data.path={fx}/truncated_array.json"), "no usable conversations"),
    Case("d_unknown_key", "scripts/data_stats.py", "mistyped config key `data.max_lenght=3`",
         _data("data.path={fx}/empty.jsonl", "data.max_lenght=3"), "unknown config key 'data.max_lenght'"),
    # ------------------------------------------------------------------ scripts/regenerate.py
    Case("r_missing_out", "scripts/regenerate.py", "no `out=`", _regen(), "out=FILE.jsonl"),
    Case("r_unwritable_out", "scripts/regenerate.py", "out= under a regular file", _regen("out={fx}/a_file/r.jsonl"),
         "a file is in the way"),
    Case("r_foreign_out", "scripts/regenerate.py", "out= an existing file this script did not write",
         _regen("out={out}/r.jsonl"), "not a line this script writes", setup=_copy("malformed.jsonl", "r.jsonl")),
    Case("r_no_assistant", "scripts/regenerate.py", "conversations without an assistant turn",
         _regen("out={out}/r.jsonl", "data=jsonl", "data.path={fx}/no_assistant.jsonl"), "no_assistant_turn"),
    Case("r_negative_temperature", "scripts/regenerate.py", "`temperature=-1`",
         _regen("out={out}/r.jsonl", "temperature=-1"), "temperature >= 0"),
]


def cases() -> list[Case]:
    """The cases whose entry point exists in this checkout (train/layerskip.py may not yet)."""
    return [c for c in CASES if (ROOT / c.script).is_file()]


# ------------------------------------------------------------------------------------------------ fixtures


def build_fixtures(fx: Path) -> None:
    """Everything the cases read: heads, checkpoints, data and prompts files, good and bad."""
    import torch
    from safetensors.torch import save_file

    from heads.checkpoint import head_record, save_head, save_single_file
    from heads.eagle import build_eagle
    from heads.target import load_target
    from train.state import save_state

    fx.mkdir(parents=True, exist_ok=True)
    llama, qwen2 = load_target("tiny:llama"), load_target("tiny:qwen2")
    torch.manual_seed(0)
    head, qhead = build_eagle(llama.model), build_eagle(qwen2.model)
    save_head(head, fx / "head", head_record(head, llama.identity))
    save_head(qhead, fx / "head_qwen2", head_record(qhead, qwen2.identity))
    blob = save_single_file(head, fx / "head.safetensors", head_record(head, llama.identity)).read_bytes()
    (fx / "truncated.safetensors").write_bytes(blob[: len(blob) // 2])
    shutil.copytree(fx / "head", fx / "head_corrupt")
    (fx / "head_corrupt" / "model.safetensors").write_bytes(os.urandom(300))
    shutil.copytree(fx / "head", fx / "head_future")
    record = json.loads((fx / "head_future" / "config.json").read_text())
    (fx / "head_future" / "config.json").write_text(json.dumps({**record, "format_version": 99}))
    save_file({"weight": torch.zeros(3)}, str(fx / "foreign.safetensors"))
    torch.save({"weight": torch.zeros(3)}, fx / "foreign.pt")
    torch.save({"selfspec_config": "{}", "state_dict": _Payload(str(fx / PWNED))}, fx / "evil.pt")

    # resumable checkpoints: a good one of a tiny-qwen2 head (foreign to tiny-llama runs), a corrupt one, one
    # whose trainer.pt is a malicious pickle
    opt = torch.optim.AdamW(qhead.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    made = save_state(fx / "qrun", 1, qhead.state_dict(), opt.state_dict(), sched.state_dict(), {"epoch": 0, "batch": 1})
    shutil.copytree(made, fx / "ckpt_qwen2")
    shutil.copytree(made, fx / "ckpt_corrupt")
    (fx / "ckpt_corrupt" / "head.safetensors").write_bytes(os.urandom(200))
    shutil.copytree(made, fx / "ckpt_evil")
    torch.save({"optimizer": _Payload(str(fx / PWNED))}, fx / "ckpt_evil" / "trainer.pt")
    shutil.rmtree(fx / "qrun")

    conv = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there"}]}
    line = json.dumps(conv)
    (fx / "empty.jsonl").write_text("")
    (fx / "malformed.jsonl").write_text(line + "\n{not json\n")
    (fx / "truncated.jsonl").write_text(line + "\n" + line[: len(line) // 2])
    (fx / "latin1.jsonl").write_bytes(line.replace("hello", "caf\xe9").encode("latin-1") + b"\n")
    (fx / "no_assistant.jsonl").write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"}]}) + "\n")
    (fx / "truncated_array.json").write_text("[" + line[: len(line) // 2])
    (fx / "malformed_prompts.jsonl").write_text('{"prompt": "hi"}\n{"prompt": \n')
    (fx / "latin1_prompts.jsonl").write_bytes('{"prompt": "caf\xe9"}\n'.encode("latin-1"))
    (fx / "long_second.jsonl").write_text(json.dumps({"prompt": "hi"}) + "\n" + json.dumps({"prompt": "x" * 600}) + "\n")
    (fx / "a_file").write_text("a regular file where a folder is expected\n")


class _Payload:
    """Unpickling this runs `touch <path>`: what a malicious checkpoint would do (with weights_only=False)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


# ------------------------------------------------------------------------------------------------ running


# Run an entry point with file writers that fail like a full disk: a few bytes land, then ENOSPC.
DISK_FULL = r"""
import errno, runpy, sys
import safetensors.torch, torch

def _full(*args, **kwargs):
    path = args[1] if len(args) > 1 else kwargs.get("filename", kwargs.get("f"))
    if isinstance(path, (str, bytes)) or hasattr(path, "__fspath__"):
        with open(path, "wb") as f:
            f.write(b"partial")
    raise OSError(errno.ENOSPC, "No space left on device", str(path))

safetensors.torch.save_file = _full
torch.save = _full
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""


@dataclass
class Outcome:
    case: Case
    returncode: int
    stderr: str
    seconds: float
    changed: list[str] = field(default_factory=list)  # files created, changed or removed under the case folders

    @property
    def last_line(self) -> str:
        lines = [ln.strip() for ln in self.stderr.replace("\r", "\n").splitlines() if ln.strip()]
        return lines[-1] if lines else ""

    def problems(self) -> list[str]:
        """How this outcome breaks the contract (empty: it keeps it)."""
        out = []
        if self.returncode == 0:
            out.append("exit code 0")
        if not self.last_line.startswith("error: "):
            out.append(f"last stderr line is not `error: ...`: {self.last_line[:200]!r}")
        elif self.case.expect.lower() not in self.last_line.lower():
            out.append(f"the error does not say {self.case.expect!r}")
        if "Traceback" in self.stderr:
            out.append("a traceback was printed")
        if self.changed:
            out.append(f"left files behind: {self.changed[:4]}")
        return out


def _snapshot(*folders: Path) -> dict[str, str]:
    files = {}
    for folder in folders:
        if folder.exists():
            for p in folder.rglob("*"):
                if p.is_file():
                    files[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return files


def run_case(case: Case, fx: Path, work: Path, debug: bool = False, timeout: float = 300) -> Outcome:
    out = work / case.id
    shutil.rmtree(out, ignore_errors=True)
    if case.setup is not None:
        case.setup(fx, out)
    before = _snapshot(fx, out)
    args = case.args(fx, out)
    cmd = [sys.executable, "-c", DISK_FULL, case.script, *args] if case.disk_full else [sys.executable, case.script, *args]
    env = {k: v for k, v in os.environ.items() if k != "SELFSPEC_DEBUG"}
    if debug:
        env["SELFSPEC_DEBUG"] = "1"
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    after = _snapshot(fx, out)
    changed = sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))
    return Outcome(case, proc.returncode, proc.stderr, round(time.time() - t0, 1), changed)


def run_all(selected: list[Case], fx: Path, work: Path, workers: int = 2) -> list[Outcome]:
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(lambda c: run_case(c, fx, work), selected))


def table(outcomes: list[Outcome]) -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| entry point | bad input | exit | the one-line message (last stderr line) |", "|---|---|---|---|"]
    for o in outcomes:
        flag = "" if not o.problems() else " **(contract broken: " + "; ".join(o.problems()) + ")**"
        lines.append(f"| `{o.case.script}` | {cell(o.case.what)} | {o.returncode} | `{cell(o.last_line)}`{flag} |")
    return "\n".join(lines)


@dataclass
class BadInputsConfig:
    """Schema of conf/bad_inputs.yaml."""

    # Run only the cases whose id starts with one of these prefixes ([] = all).
    only: list[str] = field(default_factory=list)
    # Subprocesses run at once.
    workers: int = 2
    # Also write the markdown table here (null = stdout only).
    output_file: Optional[str] = None


def _main(cfg) -> dict:
    from heads.errors import UserError

    selected = [c for c in cases() if not cfg.only or c.id.startswith(tuple(cfg.only))]
    if not selected:
        raise UserError(f"no case id starts with {list(cfg.only)}; ids: {', '.join(c.id for c in cases())}")
    with tempfile.TemporaryDirectory(prefix="selfspec-bad-inputs-") as tmp:
        fx, work = Path(tmp) / "fixtures", Path(tmp) / "runs"
        build_fixtures(fx)
        outcomes = run_all(selected, fx, work, cfg.workers)
    text = table(outcomes)
    print(text)
    if cfg.output_file:
        Path(cfg.output_file).write_text(text + "\n")
    broken = [o for o in outcomes if o.problems()]
    summary = {"cases": len(outcomes), "entry_points": len({o.case.script for o in outcomes}), "broken": len(broken)}
    print(json.dumps(summary), flush=True)
    if broken:
        raise UserError(f"{len(broken)} of {len(outcomes)} cases break the one-line-error contract (see the table)")
    return summary


def main(argv: Optional[list[str]] = None):
    from heads.cli import entry

    return entry("bad_inputs", BadInputsConfig)(_main)(argv)


if __name__ == "__main__":
    main()
