"""The installed package, not the checkout: build a wheel, install it into a fresh venv outside the checkout, and run
the `selfspec` command from a folder outside it (help, a 2-step tiny training, generation with that head).

The fresh venv gets no dependencies installed: a `.pth` file lists the project venv's site-packages, so torch and
the rest are importable. A folder named in a .pth file is added to sys.path without its own .pth files being read,
so the checkout's editable install (a .pth-activated finder there) stays out, and `selfspec` must come from the
wheel: the test checks that, and that Hydra reads the config files the wheel installed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# What is not part of the package source (mirrors .gitignore): never copied into the build.
NOT_SOURCE = (".git", ".venv", ".venv-vllm", ".llamacpp", "outputs", "build", "dist", "*.egg-info", "__pycache__",
              ".pytest_cache", "wandb", ".hydra")
TINY = ["target=tiny-llama", "data=tiny", "data.max_conversations=8", "train.max_steps=2", "train.eval_prompts=0",
        "train.save_every=0", "train.log_every=1"]


def _run(cmd: list, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SELFSPEC_DEBUG")}
    env.update(HF_HUB_OFFLINE="1", PYTHONNOUSERSITE="1", PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    cmd = [str(c) for c in cmd]
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"{' '.join(cmd)}: exit {res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    return res


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A fresh venv outside the checkout with the wheel of the checkout installed (no dependencies)."""
    tmp = tmp_path_factory.mktemp("install")
    source = tmp / "source"  # a copy: building in the checkout would leave build/ there, and races other builds
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*NOT_SOURCE))
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", tmp / "dist", source],
         cwd=tmp, timeout=300)
    wheel = next((tmp / "dist").glob("selfspec-*.whl"))
    env = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", env], cwd=tmp)
    python = env / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", wheel], cwd=tmp)
    site = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp).stdout.strip()
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}  # the project venv's packages
    (Path(site) / "_selfspec_test_deps.pth").write_text("\n".join(sorted(ours)) + "\n")
    return env


@pytest.mark.slow
def test_the_installed_wheel_trains_and_generates(venv, tmp_path):
    work = tmp_path / "work"  # cwd outside the checkout: nothing can be imported or read from it
    work.mkdir()
    where = _run([venv / "bin" / "python", "-c",
                  "import selfspec, selfspec.core.cli as c; print(selfspec.__file__); print(c.CONF_DIR)"], cwd=work)
    package, conf = (Path(line) for line in where.stdout.split())
    assert venv in package.parents and venv in conf.parents, where.stdout  # the wheel's copy, not the checkout
    assert not (package.parent / "setup.py").exists()  # the build script sits in the root package's folder only
    assert (conf / "generate.yaml").is_file() and (conf / "target" / "tiny-llama.yaml").is_file()
    assert (package.parent / "methods" / "eagle" / "conf" / "train_eagle.yaml").is_file()  # a method's own conf/

    selfspec = venv / "bin" / "selfspec"  # the console script the wheel declares
    listing = _run([selfspec, "--help"], cwd=work).stdout
    assert "train eagle" in listing and "generate" in listing
    help_ = _run([selfspec, "train", "eagle", "--help"], cwd=work).stdout
    recipe = package.parent / "methods" / "eagle" / "conf" / "train_eagle.yaml"
    assert help_.startswith("usage: selfspec train eagle") and f"Config files: {recipe}; " in help_  # Hydra reads these

    out = tmp_path / "run"
    _run([selfspec, "train", "eagle", *TINY, f"output_dir={out}"], cwd=work)
    assert (out / "head" / "model.safetensors").is_file() and (out / "config.yaml").is_file()

    rows = tmp_path / "gen" / "rows.jsonl"
    gen = _run([selfspec, "generate", "target=tiny-llama", f"head={out / 'head'}", "prompt=hello", "max_new_tokens=8",
                f"output_file={rows}"], cwd=work)
    assert "tau" in gen.stdout and rows.read_text().count("\n") == 1
    assert "head:" in (tmp_path / "gen" / "rows.config.yaml").read_text()  # the composed config, beside the output


def _setup_module():
    """setup.py's `packages` and `package_data`, imported without running setup() (it runs as __main__ only)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("selfspec_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_package_folder_of_the_checkout_ships_in_the_wheel():
    """setup.py finds the packages (the checkout's root is the `selfspec` package): every folder with an __init__.py
    outside tests/ and docs/ ships, conf/ ships as package data, and so does each method's own conf/."""
    setup = _setup_module()
    skip = ("tests", "outputs", "docs", "build")
    found = {".".join(("selfspec", *p.parent.relative_to(ROOT).parts)) for p in ROOT.rglob("__init__.py")
             if not p.parent.relative_to(ROOT).parts or p.parent.relative_to(ROOT).parts[0] not in skip
             and not p.parent.relative_to(ROOT).parts[0].startswith(".")}
    assert set(setup.packages(ROOT)) == found | {"selfspec.conf"}  # conf/: package data only
    data = setup.package_data(ROOT)
    assert {f"selfspec.methods.{d.parent.name}" for d in (ROOT / "methods").glob("*/conf")} <= set(data)
    assert data["selfspec.methods.eagle3"] == ["conf/*.yaml", "conf/*/*.yaml"]


def test_a_new_method_folder_ships_without_a_packaging_line(tmp_path):
    """A method added as one folder (methods/<name>/ with its conf/) is in the package list and its configs in the
    package data: nothing in pyproject.toml or setup.py names it."""
    setup = _setup_module()
    (tmp_path / "__init__.py").touch()
    (tmp_path / "methods" / "newmethod" / "conf" / "draft").mkdir(parents=True)
    for f in ("methods/__init__.py", "methods/newmethod/__init__.py", "methods/newmethod/conf/train_newmethod.yaml",
              "tests/__init__.py"):
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).touch()
    assert setup.packages(tmp_path) == ["selfspec", "selfspec.conf", "selfspec.methods", "selfspec.methods.newmethod"]
    assert setup.package_data(tmp_path)["selfspec.methods.newmethod"] == ["conf/*.yaml", "conf/*/*.yaml"]
    assert "newmethod" not in (ROOT / "pyproject.toml").read_text() + (ROOT / "setup.py").read_text()


def test_make_install_stops_with_one_line_on_a_full_disk(tmp_path):
    """A disk with less free than the install needs (CI once ran out mid-install) stops before the venv exists."""
    venv = tmp_path / "not" / "yet" / ".venv"
    res = subprocess.run(["make", "-s", "install", f"VENV={venv}", "MIN_FREE_GB=1000000"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stdout.count("\n") == 1 and res.stdout.startswith("error: ") and "needs 1000000 GB" in res.stdout
    assert not (tmp_path / "not").exists()
