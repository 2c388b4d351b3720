"""eval_heads / sweep_exit: bad options are one line and leave a previous output_file as it was; head_revision
reaches the head loader."""

from __future__ import annotations

import pytest

from selfspec.scripts import eval_heads, sweep_exit

SCRIPTS = {"eval_heads": eval_heads, "sweep_exit": sweep_exit}


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
        SCRIPTS[script].main(args)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and message in err, err
    assert out.read_text() == '{"previous": "report"}\n'


def test_eval_heads_head_revision_reaches_load_head(monkeypatch, capsys):
    from selfspec.heads import checkpoint as head_checkpoint

    seen = []

    def fake_load_head(spec, target, expected_type=None, revision=None):
        seen.append((spec, revision))
        raise head_checkpoint.UserError("stop here")

    monkeypatch.setattr(head_checkpoint, "load_head", fake_load_head)
    with pytest.raises(SystemExit):
        eval_heads.main(["target=tiny-llama", "data=tiny", "+heads.a=someone/tiny-eagle", "head_revision=v3"])
    assert "stop here" in capsys.readouterr().err and seen == [("someone/tiny-eagle", "v3")]
