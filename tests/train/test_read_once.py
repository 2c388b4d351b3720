"""Config is read once where a run settles it: a composed group becomes its schema dataclass (core.cli.read_once),
and the run the loop steps on keeps train.* as a TrainConfig, not the composed node it would read every step."""

import torch
from omegaconf import OmegaConf

from selfspec.core.cli import read_once
from selfspec.data.config import DataConfig
from selfspec.train.config import TrainConfig


def test_a_composed_group_becomes_its_schema_with_its_values():
    node = OmegaConf.merge(OmegaConf.structured(TrainConfig), {"lr": 1e-3, "betas": [0.8, 0.9], "max_steps": 7})
    tc = read_once(node, TrainConfig)
    assert type(tc) is TrainConfig and tc == TrainConfig(lr=1e-3, betas=[0.8, 0.9], max_steps=7)
    assert type(tc.betas) is list  # plain values all the way down
    assert read_once(tc, TrainConfig) is tc  # an instance passes as it is
    data = read_once(OmegaConf.create({"path": "synthetic", "max_length": 64}), DataConfig)  # an untyped node
    assert type(data) is DataConfig and data == DataConfig(path="synthetic", max_length=64)


def test_the_run_keeps_the_train_settings_as_values(tmp_path):
    from accelerate import Accelerator

    from selfspec.train.loop import start_run

    head = torch.nn.Linear(2, 2)
    node = OmegaConf.merge(OmegaConf.structured(TrainConfig), {"max_steps": 3, "warmup_steps": 0})
    run = start_run(Accelerator(cpu=True), head, list(head.parameters()), node, 4, tmp_path, position={})
    assert type(run.tc) is TrainConfig and run.tc == TrainConfig(max_steps=3, warmup_steps=0)
