"""The bad-input matrix (harness/bad_inputs.py CASES): every entry point run as a real process on bad input (a
child forked from a warm Python that has imported torch, transformers and selfspec: harness/warm_python.py) exits
non-zero with ONE last stderr line `error: ...` that names the problem, prints no traceback (unless
SELFSPEC_DEBUG=1), and leaves no file behind. Loading never runs pickled code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from harness import bad_inputs as bad
from harness.warm_python import WarmPython

ROOT = Path(__file__).resolve().parents[2]
CASES = bad.cases()


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    fx = tmp_path_factory.mktemp("bad_inputs") / "fixtures"
    bad.build_fixtures(fx)
    return fx


@pytest.fixture(scope="module")
def warm():
    """Two warm Pythons (harness/warm_python.py), importing while the fixtures are built."""
    pythons = bad.warm_pythons(2)
    yield pythons
    for python in pythons:
        python.close()


@pytest.fixture(scope="module")
def outcomes(warm, fixtures):
    """Every case, two processes at a time."""
    return {o.case.id: o for o in bad.run_all(CASES, fixtures, fixtures.parent / "runs", pythons=warm)}


def test_the_matrix_is_wide_enough():
    assert len(CASES) >= 120
    assert {c.script for c in CASES} >= {
        "methods/eagle/train.py", "methods/eagle3/train.py", "methods/layerskip/train.py", "decode/generate.py",
        "scripts/bench.py",
        "scripts/data_stats.py", "scripts/regenerate.py", "scripts/export.py", "scripts/publish.py",
        "scripts/eval_heads.py", "scripts/cache_features.py", "scripts/sweep_exit.py", "scripts/check_vllm.py",
        "scripts/import_head.py", "methods/dflash/train.py"}
    assert sum(c.setup is not None for c in CASES) >= 15  # cases where the user already had files there


@pytest.mark.parametrize("in_warm", [False, True], ids=["fresh", "warm"])
def test_the_harness_sees_a_changed_user_file(tmp_path, in_warm):
    """The untouched check itself: an entry point that appends to the user's old output is caught, even though
    it exits with a proper one-line error; in a fresh interpreter and in a child of the warm one alike."""
    script = tmp_path / "appends.py"
    script.write_text("import sys\nopen(sys.argv[1], 'a').write('x')\nsys.exit('error: refused')\n")
    (tmp_path / "fx").mkdir()
    (tmp_path / "fx" / "old.jsonl").write_text("an earlier output\n")
    case = bad.Case("meta", str(script), "appends to an old output", lambda fx, out: [str(out / "o.jsonl")],
                    "refused", setup=bad._copy("old.jsonl", "o.jsonl"), code=1)
    python = WarmPython(bad._env(), preload=False) if in_warm else None
    try:
        o = bad.run_case(case, tmp_path / "fx", tmp_path / "runs", python=python)
    finally:
        if python is not None:
            python.close()
    assert o.kept == 1 and not o.untouched and o.changed == ["meta/o.jsonl"]
    assert o.problems() == ["files created, changed or removed: ['meta/o.jsonl']"]
    assert o.returncode == 1 and o.last_line == "error: refused"


def test_a_warm_child_exits_as_python_would(tmp_path):
    """harness/warm_python.py's children: exit codes, messages, tracebacks and atexit handlers as a fresh `python
    script.py` gives them, in the working directory and environment asked for."""
    script = tmp_path / "s.py"
    script.write_text("import atexit, os, sys\n"
                      "atexit.register(lambda: open('atexit_ran', 'w').write(os.environ['X']))\n"
                      "mode = sys.argv[1]\n"
                      "if mode == 'raise': raise ValueError('boom')\n"
                      "if mode == 'int': sys.exit(3)\n"
                      "if mode == 'str': sys.exit('error: said so')\n")
    python = WarmPython(bad._env(), preload=False)
    try:
        runs = {mode: python.run(str(script), [mode], tmp_path, {**bad._env(), "X": mode}, timeout=60)
                for mode in ("ok", "raise", "int", "str")}
    finally:
        python.close()
    assert runs["ok"] == (0, "")
    assert runs["raise"][0] == 1 and "Traceback" in runs["raise"][1] and "ValueError: boom" in runs["raise"][1]
    assert runs["int"] == (3, "")
    assert runs["str"] == (1, "error: said so\n")
    assert (tmp_path / "atexit_ran").read_text() == "str"  # the last run's handler, in its cwd, with its env


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_gives_one_line_and_leaves_nothing(case, outcomes, fixtures):
    o = outcomes[case.id]
    assert not o.problems(), f"{case.script} [{case.what}]: {o.problems()}\n--- stderr tail:\n{o.stderr[-1500:]}"
    assert not (fixtures / bad.PWNED).exists()  # no pickle payload ever ran


def test_debug_mode_shows_the_traceback(fixtures, tmp_path, warm):
    case = next(c for c in CASES if c.id == "g_truncated_head")
    o = bad.run_case(case, fixtures, tmp_path, debug=True, python=warm[0])
    assert o.returncode != 0 and "Traceback" in o.stderr


# ------------------------------------------------------------------------------ no pickled code is ever run

LOADERS = ["core", "heads", "train", "decode", "data", "eval", "publish", "scripts"]


def _python_files():
    return [p for d in LOADERS for p in sorted((ROOT / d).rglob("*.py"))]


def test_every_torch_load_is_weights_only():
    """Checkpoints are safetensors or `torch.load(..., weights_only=True)`; nothing unpickles with pickle."""
    offenders = []
    for path in _python_files():
        text = path.read_text()
        for m in re.finditer(r"torch\.load\(", text):
            call = text[m.start(): text.find("\n\n", m.start())]  # the call and what follows it closely
            depth, end = 0, 0
            for i, ch in enumerate(call):
                depth += ch == "("
                depth -= ch == ")"
                if depth == 0 and ch == ")":
                    end = i
                    break
            if "weights_only=True" not in call[:end]:
                offenders.append(f"{path.relative_to(ROOT)}: {call[:end + 1]}")
        for m in re.finditer(r"\b(pickle|dill|cloudpickle|joblib)\.loads?\(|\bnp\.load\([^)]*allow_pickle=True", text):
            offenders.append(f"{path.relative_to(ROOT)}: {m.group(0)}")
    assert not offenders, offenders


def test_a_malicious_pickle_is_refused_in_process(tmp_path):
    import torch

    from selfspec.heads.checkpoint import read_head
    from selfspec.core.errors import UserError
    from selfspec.train.state import load_state

    marker = tmp_path / "ran"
    torch.save({"selfspec_config": "{}", "state_dict": bad._Payload(str(marker))}, tmp_path / "evil.pt")
    with pytest.raises(UserError, match="refused"):
        read_head(str(tmp_path / "evil.pt"))
    from safetensors.torch import save_file

    ckpt = tmp_path / "step_00000001"
    ckpt.mkdir()
    save_file({"w": torch.zeros(2)}, str(ckpt / "head.safetensors"))  # a good head: trainer.pt is reached
    torch.save({"optimizer": bad._Payload(str(marker))}, ckpt / "trainer.pt")
    (ckpt / "position.json").write_text('{"step": 1}')
    with pytest.raises(UserError):
        load_state(ckpt)
    assert not marker.exists()
