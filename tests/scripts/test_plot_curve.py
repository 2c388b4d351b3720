"""scripts/plot_curve.py: eval_heads reports -> one line per trainer, x from each head's recorded training time."""

import json

import pytest

from selfspec.core.errors import UserError
from selfspec.scripts import plot_curve


def _report(**heads):
    return {"prompts": 48, "heads": {name: {"tau": tau, "sem": 0.1, **({"train_seconds": s} if s else {})}
                                     for name, (tau, s) in heads.items()}}


def test_points_group_by_series_and_sort_by_minutes(capsys):
    series = plot_curve.points([_report(selfspec_60=(2.0, 3600.0), selfspec_15=(1.5, 900.0),
                                        eagle_ref_30=(1.2, 1800.0)),
                                _report(shipped=(2.4, 6846.0), untimed_1=(1.0, None))])
    assert series == {"selfspec": [(15.0, 1.5, 0.1), (60.0, 2.0, 0.1)], "eagle_ref": [(30.0, 1.2, 0.1)]}
    out = capsys.readouterr().out
    assert "left out 'shipped': no SERIES_LABEL name" in out and "left out 'untimed_1'" in out


def test_writes_the_png(tmp_path):
    report = tmp_path / "r.json"
    report.write_text(json.dumps(_report(a_1=(1.5, 60.0), a_2=(1.8, 120.0), b_1=(1.2, 60.0))))
    result = plot_curve.main(argv=[f"+reports=[{report}]", f"out={tmp_path / 'c.png'}"])
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result["series"] == {"a": [[1.0, 1.5, 0.1], [2.0, 1.8, 0.1]], "b": [[1.0, 1.2, 0.1]]}


@pytest.mark.parametrize("content, match", [("{", "cannot read"), ('{"x": 1}', "not an eval_heads report"),
                                            (json.dumps(_report(plain=(1.0, 5.0))), "no head named")])
def test_bad_reports_are_one_line_errors(tmp_path, content, match):
    (tmp_path / "r.json").write_text(content)
    with pytest.raises(UserError, match=match):
        plot_curve.main.__wrapped__(plot_curve.PlotCurveConfig(reports=[str(tmp_path / "r.json")],
                                                               out=str(tmp_path / "c.png")))
    assert not (tmp_path / "c.png").exists()
