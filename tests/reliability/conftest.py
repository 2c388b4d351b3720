"""Fixtures the reliability tests share: the tiny target and one saved EAGLE head."""

import pytest
import torch

from selfspec.target.model import load_target
from selfspec.heads.checkpoint import head_record, save_head
from selfspec.methods.eagle.head import build_eagle


@pytest.fixture(scope="module")
def target():
    return load_target("tiny:llama")


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory, target):
    torch.manual_seed(0)
    head = build_eagle(target.model)
    folder = tmp_path_factory.mktemp("heads") / "head"
    save_head(head, folder, head_record(head, target.identity, training={"recipe": "test"}, metrics={}))
    return folder
