"""Issue 62: the README's table is the rendering of the report it comes from (docs/reports/suites.json, written by
`make readme-figures` from `make check-suites`'s report), so a figure cannot drift from its measurement."""

import json
from pathlib import Path

from selfspec.engines.suites import front_table, summary

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_table_is_the_rendering_of_its_report():
    report = json.loads((ROOT / "docs" / "reports" / "suites.json").read_text())
    table = front_table(report)
    assert table in (ROOT / "README.md").read_text(), "README's table is not front_table(docs/reports/suites.json)"
    assert report["date"] in table and report["machine"] in table


def test_a_summary_keeps_each_rows_whole_suite_figures_and_drops_the_token_ids():
    report = {"date": "2026-11-29 12:11", "machine": "AMD EPYC, 2 CPUs", "prompts": 2, "tokens": {"x": [[1]]},
              "categories": {"selfspec fp32": {
                  "plain": {"all": {"prompts": 2, "speedup": 1.0, "identical": 2, "tokens_per_pass": 1.0}},
                  "suffix": {"math": {}, "all": {"prompts": 2, "speedup": 1.5, "identical": 2, "tokens_per_pass": 1.8}},
                  "eagle head + lookup": {"all": {"prompts": 2, "speedup": 1.9, "identical": 1,
                                                  "tokens_per_pass": None}}}}}
    s = summary(report)
    assert "tokens" not in s and "categories" not in s and s["all"]["selfspec fp32"]["suffix"]["speedup"] == 1.5
    lines = front_table(s).splitlines()
    assert lines[4:] == ["| selfspec fp32 | `suffix` | 1.50x | 1.80 | 2/2 |",
                         "| selfspec fp32 | `eagle head + lookup` | 1.90x | - | 1/2 |"]
