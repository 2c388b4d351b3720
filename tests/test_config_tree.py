"""Every YAML in conf/ and in the method folders' conf/ composes against its schema (through each entry point's own
`--cfg`), so do the test harnesses' configs (their schemas alone: conf/ holds none of them), unknown keys fail in one
line, and no config group is named `head` (it would turn `head=ckpt.pt` into a group choice)."""

import importlib
from pathlib import Path

import pytest

from selfspec.core.cli import conf_dirs

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
# primary config -> the script whose entry point owns it
ENTRY = {
    "train_eagle": "methods/eagle/train.py", "train_eagle3": "methods/eagle3/train.py",
    "train_layerskip": "methods/layerskip/train.py",
    "train_dflash": "methods/dflash/train.py", "train_peagle": "methods/peagle/train.py",
    "train_dspark": "methods/dspark/train.py",
    "generate": "decode/generate.py", "bench": "scripts/bench.py", "data_stats": "scripts/data_stats.py",
    "regenerate": "scripts/regenerate.py", "cache_features": "scripts/cache_features.py",
    "publish": "scripts/publish.py", "export": "scripts/export.py", "check_vllm": "scripts/check_vllm.py",
    "check_engine_families": "scripts/check_engine_families.py",
    "check_vllm_features": "scripts/check_vllm_features.py", "check_gpu": "scripts/check_gpu.py",
    "sweep_exit": "scripts/sweep_exit.py",
    "profile_step": "scripts/profile_step.py", "eval_heads": "scripts/eval_heads.py",
    "serve_bench": "scripts/serve_bench.py",
    "import_head": "scripts/import_head.py", "peer_eagle": "scripts/peer_eagle.py",
    "plot_curve": "scripts/plot_curve.py", "contention": "scripts/contention.py",
    "replay_lookup": "scripts/replay_lookup.py",
}
HARNESSES = ("fuzz", "kill_resume", "bad_inputs", "fault_injection")  # tests/harness/<name>.py, config <name>
EXPERIMENTS = {"demo_eagle": "train_eagle", "demo_eagle3": "train_eagle3", "demo_layerskip": "train_layerskip",
               "smollm2_eagle_full": "train_eagle", "smollm2_eagle3_full": "train_eagle3",
               "demo_dflash": "train_dflash", "smollm2_dflash_full": "train_dflash",
               "qwen_coder_eagle3": "train_eagle3", "smollm2_peagle": "train_peagle"}


def _yamls(where: str = "") -> list[Path]:
    """The YAMLs of one folder (`draft`, or "" for the primary configs) across conf/ and every method's conf/."""
    return sorted((p for d in conf_dirs() for p in (d / where).glob("*.yaml")), key=lambda p: p.stem)


def _main(script: str):
    """The entry point of `script` (methods/eagle/train.py -> selfspec.methods.eagle.train.main; a harness's name ->
    its main)."""
    if script in HARNESSES:
        return importlib.import_module(f"harness.{script}").main
    return importlib.import_module("selfspec." + script.removesuffix(".py").replace("/", ".")).main


def _cases():
    cases = [(name, []) for name in ENTRY]
    cases += [(name, []) for name in HARNESSES]
    for group in ("target", "data", "logger"):
        cases += [("train_eagle", [f"{group}={p.stem}"]) for p in sorted((CONF / group).glob("*.yaml"))]
    # a draft without its own recipe composes under train_eagle: every recipe takes every draft schema
    cases += [(f"train_{p.stem}" if f"train_{p.stem}" in ENTRY else "train_eagle", [f"draft={p.stem}"])
              for p in _yamls("draft")]
    cases += [(primary, [f"experiment={exp}"]) for exp, primary in EXPERIMENTS.items()]
    return cases


def test_every_yaml_is_covered():
    primaries = [p.stem for p in _yamls()]
    assert sorted(primaries) == sorted(ENTRY), set(primaries) ^ set(ENTRY)  # each once; none of the HARNESSES
    assert sorted(p.stem for p in _yamls("draft")) == sorted(m.removeprefix("train_") for m in ENTRY
                                                                if m.startswith("train_"))  # a draft per recipe
    for method in (ROOT / "methods").glob("*/conf"):  # a method's folder holds its own recipe and draft only
        assert {str(p.relative_to(method)) for p in method.rglob("*.yaml")} == {
            f"train_{method.parent.name}.yaml", f"draft/{method.parent.name}.yaml"}, method
    assert {p.stem for p in (CONF / "experiment").glob("*.yaml")} == set(EXPERIMENTS)
    assert not (CONF / "head").exists()


@pytest.mark.parametrize("primary, overrides", _cases(), ids=lambda x: x if isinstance(x, str) else ",".join(x))
def test_composes(primary, overrides, capsys):
    assert _main(ENTRY.get(primary, primary))(argv=[*overrides, "--cfg"]) is None
    assert capsys.readouterr().out.strip()


def test_unknown_key_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        _main(ENTRY["generate"])(argv=["max_new_tokenz=3", "--cfg"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "max_new_tokenz" in err
