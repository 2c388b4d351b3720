"""llama.cpp's own converter (convert_hf_to_gguf.py) for the GGUF byte-identity tests in tests/publish/: where its
tree is, and one interpreter running many conversions."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

NO_TREE = "no llama.cpp tree (make check-llamacpp unpacks it to .llamacpp/src; or set SELFSPEC_LLAMACPP_SRC)"

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


def converter_env(src: Path, pydeps: Path) -> dict[str, str]:
    """The environment the converter imports gguf-py and its extra dependencies from."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(src / "gguf-py"), str(pydeps)]))


def run_converter(src: Path, pydeps: Path, jobs: list[list[str]]) -> None:
    """Each job (the converter's arguments) through RUN_CONVERTER; fails the test with the converter's stderr."""
    p = subprocess.run([sys.executable, "-c", RUN_CONVERTER, str(src), *("|".join(job) for job in jobs)],
                       env=converter_env(src, pydeps), capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
