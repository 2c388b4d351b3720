"""core/cli.owned_output: the one output routine of the entry points that write a report (every output checked before
the work, the report replaced atomically after it, the config saved beside it). Pure file work: milliseconds."""

from __future__ import annotations

import os

import pytest
from omegaconf import OmegaConf

from selfspec.core.cli import config_path, owned_output
from selfspec.core.errors import UserError
from selfspec.core.ownership import CONFIG_HEADER, PNG, Kind, json_keys

REPORT = Kind("test report", folder=False, mine=json_keys("rows"))


def _cfg(**kw):
    return OmegaConf.create({"overwrite": False, "rows": 3, **kw})


def _files(folder) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("users", ["r.json", "r.config.yaml", "r.png"])
def test_a_users_file_at_any_output_is_refused_before_the_work(tmp_path, users):
    (tmp_path / users).write_text("the user's\n")
    before, ran = _files(tmp_path), []
    with pytest.raises(UserError, match="exists and is not a .* selfspec wrote .* pass overwrite=true"):
        with owned_output(_cfg(), tmp_path / "r.json", "output_file", REPORT,
                          also=[(tmp_path / "r.png", "plot", PNG)]):
            ran.append(True)
    assert not ran and _files(tmp_path) == before  # nothing ran, nothing written, no lock or temp file left


def test_an_output_that_is_an_input_is_refused_before_the_work(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    with pytest.raises(UserError, match="is the input prompts_file"):
        with owned_output(_cfg(overwrite=True), prompts, "output_file", REPORT, [("prompts_file", prompts)]):
            pytest.fail("the work ran")
    assert prompts.read_text() == '{"prompt": "hi"}\n'


def test_the_report_and_its_config_are_written_after_the_work(tmp_path):
    out, cfg = tmp_path / "sub" / "r.json", _cfg()
    with owned_output(cfg, out, "output_file", REPORT) as tmp:
        assert tmp.parent == out.parent and tmp != out and not out.exists()  # a temp file beside it, during the work
        tmp.write_text('{"rows": 1}\n')
        cfg.rows = 4  # what the work decided: the config saved says what ran
        assert not config_path(out).exists()
    assert out.read_text() == '{"rows": 1}\n'
    saved = config_path(out).read_text()
    assert saved.startswith(CONFIG_HEADER) and OmegaConf.create(saved).rows == 4
    assert sorted(os.listdir(out.parent)) == ["r.config.yaml", "r.json"]  # no temp file, no lock left
    with owned_output(cfg, out, "output_file", REPORT) as tmp:  # its own report and config: replaced
        tmp.write_text('{"rows": 2}\n')
    assert out.read_text() == '{"rows": 2}\n'


def test_a_failed_work_leaves_the_previous_outputs_as_they_were(tmp_path):
    out, cfg = tmp_path / "r.json", _cfg()
    with owned_output(cfg, out, "output_file", REPORT) as tmp:
        tmp.write_text('{"rows": 1}\n')
    before = _files(tmp_path)
    with pytest.raises(RuntimeError, match="mid-work"):
        with owned_output(_cfg(rows=9), out, "output_file", REPORT) as tmp:
            tmp.write_text('{"rows": "half"')
            raise RuntimeError("mid-work")
    assert _files(tmp_path) == before


def test_a_refusal_in_the_work_leaves_no_new_folder(tmp_path):
    with pytest.raises(UserError):
        with owned_output(_cfg(), tmp_path / "new" / "r.json", "output_file", REPORT):
            raise UserError("a bad prompt")
    assert list(tmp_path.iterdir()) == []


def test_overwrite_replaces_a_users_file(tmp_path):
    (tmp_path / "r.json").write_text("the user's\n")
    with owned_output(_cfg(overwrite=True), tmp_path / "r.json", "output_file", REPORT) as tmp:
        tmp.write_text('{"rows": 1}\n')
    assert (tmp_path / "r.json").read_text() == '{"rows": 1}\n'


def test_no_output_file_checks_and_writes_nothing(tmp_path):
    with owned_output(_cfg(), None, "output_file", REPORT) as tmp:
        assert tmp is None
    assert list(tmp_path.iterdir()) == []
