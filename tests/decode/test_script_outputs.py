"""eval_heads / sweep_exit: bad options are one line and leave a previous output_file as it was; head_revision
reaches the head loader."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _main(name):
    spec = importlib.util.spec_from_file_location(f"selfspec_script_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(module)
    return module.main


@pytest.mark.parametrize("script, bad, message", [
    ("eval_heads", "depth=0", "depth must be >= 1"),
    ("eval_heads", "block=0", "block must be >= 1"),
    ("sweep_exit", "ks=[0,1]", "ks must be chain lengths >= 1"),
    ("sweep_exit", "repeats=0", "repeats must be >= 1"),
    ("sweep_exit", "exit_layers=[]", "exit_layers is empty"),
])
def test_bad_options_keep_the_previous_output(tmp_path, script, bad, message, capsys):
    out = tmp_path / "report.json"
    out.write_text('{"previous": "report"}\n')
    args = ["target=tiny-llama", "data=tiny", f"output_file={out}", bad]
    if script == "eval_heads":
        args.append("+heads.a=nowhere")
    else:
        args += [a for a in ("ks=[1]", "chain_k=1", "exit_layers=[1]") if a.split("=")[0] != bad.split("=")[0]]
    with pytest.raises(SystemExit) as e:
        _main(script)(args)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and message in err, err
    assert out.read_text() == '{"previous": "report"}\n'


def test_eval_heads_head_revision_reaches_load_head(monkeypatch, capsys):
    import heads.checkpoint

    seen = []

    def fake_load_head(spec, target, expected_type=None, revision=None):
        seen.append((spec, revision))
        raise heads.checkpoint.UserError("stop here")

    monkeypatch.setattr(heads.checkpoint, "load_head", fake_load_head)
    with pytest.raises(SystemExit):
        _main("eval_heads")(["target=tiny-llama", "data=tiny", "+heads.a=someone/tiny-eagle", "head_revision=v3"])
    assert "stop here" in capsys.readouterr().err and seen == [("someone/tiny-eagle", "v3")]
