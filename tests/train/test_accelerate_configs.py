"""Every accelerate config in conf/accelerate/ parses with accelerate's own loader and names a launchable setup."""

from pathlib import Path

import pytest
from accelerate.commands.config.config_args import load_config_from_file

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "conf" / "accelerate").glob("*.yaml"))


def test_the_documented_configs_exist():
    assert {p.stem for p in CONFIGS} >= {"cpu_2proc", "gpu_1", "gpu_ddp", "gpu_fsdp", "multinode"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_parses(path):
    cfg = load_config_from_file(str(path))
    assert cfg.num_processes >= 1 and cfg.num_machines >= 1
    assert cfg.num_processes % cfg.num_machines == 0
    if cfg.distributed_type.value == "FSDP":
        assert cfg.fsdp_config["fsdp_version"] == 2
