"""The converter tests in any order of the make targets (issue 63): after `make llamacpp` unpacked llama.cpp's tree,
21 converter tests failed with `ModuleNotFoundError: No module named 'sentencepiece'`: they found the tree but not
.llamacpp/pydeps, which only check-llamacpp's prerequisite installed. Now every target that unpacks the tree installs
the converter's imports first, and a tree without them (an older Makefile's, an interrupted make) skips those tests in
one line that says what to run (tests/llamacpp_converter.py). scripts/check_llamacpp_states.sh runs the converter
tests themselves in each state (`make check-llamacpp-states`)."""

import subprocess
from pathlib import Path

import pytest

import llamacpp_converter
from llamacpp_converter import NO_TREE, require_converter

ROOT = Path(__file__).resolve().parents[2]
DEP = "selfspec_converter_dep_probe"  # a module no interpreter has: the tests decide where it is


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """A llama.cpp tree (its converter's entry point) at $SELFSPEC_LLAMACPP_SRC, an empty pydeps folder at
    $SELFSPEC_LLAMACPP_PYDEPS, and the converter needing DEP. -> (src, pydeps)."""
    src, pydeps = tmp_path / "src", tmp_path / "pydeps"
    src.mkdir()
    pydeps.mkdir()
    (src / "convert_hf_to_gguf.py").write_text("")
    monkeypatch.setenv("SELFSPEC_LLAMACPP_SRC", str(src))
    monkeypatch.setenv("SELFSPEC_LLAMACPP_PYDEPS", str(pydeps))
    monkeypatch.setattr(llamacpp_converter, "CONVERTER_DEPS", (DEP,))
    return src, pydeps


def _skip_reason() -> str:
    with pytest.raises(pytest.skip.Exception) as e:
        require_converter()
    return str(e.value.msg)


def test_no_tree_skips_saying_so(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_LLAMACPP_SRC", str(tmp_path / "none"))
    assert _skip_reason() == NO_TREE


def test_a_tree_without_the_converters_imports_skips_saying_what_to_run(tree):
    src, pydeps = tree
    reason = _skip_reason()
    assert "\n" not in reason and str(src) in reason and DEP in reason and str(pydeps) in reason
    assert "make .llamacpp/pydeps/.installed" in reason


@pytest.mark.parametrize("layout", ["package", "module"])
def test_a_tree_with_the_converters_imports_runs(tree, layout):
    src, pydeps = tree
    if layout == "package":
        (pydeps / DEP).mkdir()
        (pydeps / DEP / "__init__.py").write_text("")
    else:
        (pydeps / f"{DEP}.py").write_text("")
    assert require_converter() == (src, pydeps)


def _dry_run(target: str, llamacpp_dir: Path) -> str:
    out = subprocess.run(["make", "-n", "-C", str(ROOT), target, f"LLAMACPP_DIR={llamacpp_dir}"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.mark.parametrize("target", ["llamacpp", "check-llamacpp", "check-suites", "check-engine-families"])
def test_every_target_that_unpacks_the_tree_installs_the_converters_imports_first(tmp_path, target):
    """On a machine without .llamacpp/, each make target that unpacks llama.cpp's tree installs the converter's
    imports (every one of CONVERTER_DEPS) into the pydeps folder the tests read, before it unpacks."""
    commands = _dry_run(target, tmp_path / "llamacpp")
    install = next((i for i, line in enumerate(commands.splitlines())
                    if "pip install" in line and f"--target {tmp_path}/llamacpp/pydeps" in line), None)
    unpack = next(i for i, line in enumerate(commands.splitlines()) if line.startswith("tar -xzf"))
    assert install is not None and install < unpack, commands
    assert all(dep in commands.splitlines()[install] for dep in llamacpp_converter.CONVERTER_DEPS)
