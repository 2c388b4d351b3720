"""`--help` on entry points (every config field with its type, value and help text) and the `selfspec` command."""

from __future__ import annotations

from pathlib import Path

import pytest

from selfspec.scripts.commands import COMMANDS, main as selfspec


def _flat(text: str) -> str:
    return " ".join(text.split())  # help lines wrap to the terminal: compare with whitespace collapsed


def test_generate_help_lists_fields_with_their_help(capsys):
    from selfspec.decode.generate import main

    assert main(["--help"]) is None  # prints, runs nothing: `python -m` exits 0
    out = _flat(capsys.readouterr().out)
    assert out.startswith("usage: python -m selfspec.decode.generate [key=value ...]")
    assert "Hydra's grammar" in out and "--cfg" in out and "target=smollm2-135m" in out
    assert ("target.dtype (str, default float32): Weights dtype: float32 gives bit-exact greedy verification" in out)
    assert "max_new_tokens (int, default 256)" in out and "tree.depth (int, default 5)" in out


def test_train_eagle_help_shows_values_as_composed_with_the_overrides(capsys):
    assert selfspec(["train", "eagle", "target=tiny-llama", "train.lr=0.001", "--help"]) == 0
    out = _flat(capsys.readouterr().out)
    assert out.startswith("usage: selfspec train eagle ")
    assert "target.name_or_path (str, default tiny:llama): Hub id or local folder of a causal LM" in out
    assert "train.lr (float, default 0.001): peak AdamW learning rate" in out
    assert "draft: EagleConfig" in out and "draft.num_layers (int, default 1)" in out  # the draft option's schema
    assert "draft=eagle (dflash, dspark, eagle, eagle3, layerskip, peagle)" in out


def test_train_dflash_help_lists_its_loss_fields(capsys):
    assert selfspec(["train", "dflash", "--help"]) == 0
    out = _flat(capsys.readouterr().out)
    assert out.startswith("usage: selfspec train dflash ") and "draft: DFlashConfig" in out
    assert "dflash.anchors (int, default 64)" in out and "dflash.loss (str, default ce)" in out
    assert "dflash.gamma (Optional[float], default null)" in out


def test_help_with_overrides_that_do_not_compose_shows_the_schemas(capsys):
    assert selfspec(["train", "eagle", "train.lrr=1", "-h"]) == 0
    out = _flat(capsys.readouterr().out)
    assert "do not compose: unknown config key 'train.lrr'" in out
    assert "draft=eagle3: Eagle3Config" in out and "train.lr (float, default 0.0003)" in out


def test_selfspec_lists_every_command(capsys):
    assert selfspec([]) == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert f"  {name}  " in out
    assert "Train an EAGLE-1/2 head from a frozen target" in out and "accelerate launch -m" in out


def test_every_shipped_script_runs_installed():
    """scripts/ ships in the wheel, so each file there is a `selfspec` subcommand, the command itself, or
    vllm_smoke.py (vLLM's interpreter runs it by path; it imports nothing of selfspec). Tools that need a checkout
    live in tests/ (tests/run_harness.py runs the harnesses), not here."""
    scripts = Path(__file__).resolve().parents[1] / "scripts"
    runnable = {m.rsplit(".", 1)[1] for m in COMMANDS.values() if m.startswith("selfspec.scripts.")}
    shipped = {p.stem for p in scripts.glob("*.py")} - {"__init__", "commands", "vllm_smoke"}
    assert shipped == runnable, shipped ^ runnable


@pytest.mark.parametrize("argv", [["nope"], ["train"], ["train", "medusa"]])
def test_unknown_command_is_one_line(argv, capsys):
    assert selfspec(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("error: ") and captured.err.count("\n") == 1


def test_save_config_writes_the_composed_config_as_yaml(tmp_path):
    from omegaconf import OmegaConf

    from selfspec.core.cli import compose_config, register, save_config
    from selfspec.decode.generate import GenerateConfig

    register("generate", GenerateConfig)
    cfg = compose_config("generate", ["target=tiny-llama", "max_new_tokens=7"])
    path = save_config(cfg, tmp_path / "o.config.yaml")
    again = OmegaConf.load(path)
    assert again.max_new_tokens == 7 and again.target.name_or_path == "tiny:llama"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.config.yaml"]  # no temp file left


def test_every_config_field_carries_its_help():
    """`--help` reads the help from the fields: every leaf field of every *Config dataclass in the package has it
    (nested config nodes are headed by their class docstring instead)."""
    import dataclasses
    import importlib
    import pkgutil

    import selfspec

    missing = []
    for info in pkgutil.walk_packages(selfspec.__path__, "selfspec."):
        if info.name.startswith(("selfspec.tests", "selfspec.conf")) or info.name == "selfspec.scripts.commands":
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if not (dataclasses.is_dataclass(obj) and name.endswith("Config") and obj.__module__ == info.name):
                continue
            for f in dataclasses.fields(obj):
                nested = f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory())
                if not nested and not f.metadata.get("help"):
                    missing.append(f"{name}.{f.name}")
    assert not missing, missing


@pytest.mark.parametrize("override", ["suite_questions.mmlu=1", "suite_questions={mmlu:1}"])
def test_an_unknown_key_inside_a_dict_node_is_named_whole(tmp_path, capsys, override):
    """Hydra reports the node it could not override ('suite_questions'); the line names the key inside it."""
    from selfspec.scripts import serve_bench

    with pytest.raises(SystemExit) as e:
        serve_bench.main([override, f"output_file={tmp_path}/r.json"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "\n" not in err and "unknown config key 'suite_questions.mmlu'" in err
    assert list(tmp_path.iterdir()) == []
