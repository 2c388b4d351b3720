"""One name for the draft length across schemas (issue 51): a key a schema renamed (its RENAMED, core/cli.py) is
refused in one line that names the new key, before anything is composed or loaded; the new keys compose."""

from __future__ import annotations

import pytest

from entry_points import refused, run
from selfspec.core.cli import compose_config, register
from selfspec.eval.bench import BenchConfig
from selfspec.engines.bench import ServeBenchConfig


@pytest.mark.parametrize("module, old, new", [
    ("selfspec.scripts.serve_bench", "eagle3_num_draft=[3,5]", "num_draft_grid.eagle3=[3,5]"),
    ("selfspec.scripts.serve_bench", "dflash_num_draft=[3]", "num_draft_grid.dflash=[3]"),
    ("selfspec.scripts.serve_bench", "+peagle_num_draft=[2]", "num_draft_grid.peagle=[2]"),
    ("selfspec.scripts.bench", "dyn_num_draft=6", "dyn.num_draft=6"),
    ("selfspec.scripts.bench", "min_confidence=0.5", "dyn.min_confidence=0.5"),
])
def test_an_old_name_is_refused_naming_the_new_one(module, old, new, capsys):
    import importlib

    main = importlib.import_module(module).main
    assert run(main, "target=tiny-llama", old) == 2
    line = refused(capsys, f"is now {new.split('=')[0]}", f"pass {new}")
    assert "unknown config key" not in line


@pytest.mark.parametrize("name, schema, overrides, read", [
    ("serve_bench", ServeBenchConfig, ["num_draft_grid.eagle3=[2,4]", "num_draft_grid.peagle=[3]"],
     lambda c: (list(c.num_draft_grid["eagle3"]), list(c.num_draft_grid["dflash"]), list(c.num_draft_grid["peagle"]))),
    ("bench", BenchConfig, ["dyn.num_draft=6", "dyn.min_confidence=0.5"],
     lambda c: (c.num_draft, c.dyn.num_draft, c.dyn.min_confidence)),
])
def test_the_new_names_compose(name, schema, overrides, read):
    register(name, schema)
    cfg = compose_config(name, overrides)
    expected = {"serve_bench": ([2, 4], [3, 7, 15], [3]), "bench": (5, 6, 0.5)}[name]
    assert read(cfg) == expected


def test_the_grid_has_a_key_per_head_type_serve_bench_compares():
    """num_draft_grid is keyed by head type from the registry (`hybrid`): every type serve_bench compares has its
    own lengths (EAGLE-1's chain its own, not EAGLE-3's), LayerSkip none."""
    from selfspec.engines.bench import compared

    register("serve_bench", ServeBenchConfig)
    cfg = compose_config("serve_bench", ["num_draft_grid.eagle=[2]"])
    assert set(cfg.num_draft_grid) == set(compared()) and "layerskip" not in cfg.num_draft_grid
    assert list(cfg.num_draft_grid["eagle"]) == [2] and list(cfg.num_draft_grid["eagle3"]) == [3, 5]


def test_a_misspelled_head_type_in_the_grid_is_refused(capsys):
    """Misspelled: Hydra's unknown key, in one line; added with `+` (a free-form dict takes it): serve_bench's own
    check names the types it compares, before the target loads."""
    from selfspec.core.errors import UserError
    from selfspec.scripts.serve_bench import main

    register("serve_bench", ServeBenchConfig)
    with pytest.raises(UserError, match="num_draft_grid.eagel"):
        compose_config("serve_bench", ["num_draft_grid.eagel=[3]"])
    assert run(main, "target=tiny-llama", "+num_draft_grid.medusa=[3]") == 2
    refused(capsys, "num_draft_grid.medusa: not a head type serve_bench compares (eagle, eagle3")
