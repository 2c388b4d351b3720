"""Shared by the export tests (tests/publish/): a head's record and weights as the exporters take them, a head moved
off its init, and the heads of the RoPE cases."""

import torch

from selfspec.target.model import load_target
from selfspec.heads.checkpoint import head_record


def export_record(head, target) -> dict:
    return head_record(head, target.identity, training={"recipe": "test"}, metrics={})


def export_state(head) -> dict:
    return {k: v.detach().clone() for k, v in head.state_dict().items()}


def jittered(head, scale: float = 0.1):
    """head, every parameter moved by torch.randn_like noise times `scale` (norms away from 1). -> head."""
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * scale)
    return head


def rope_cases(cases: dict, build) -> dict:
    """{name: (tiny family, config overrides, *args)} -> {name: (target, head, record, state)}: the family's tiny
    target with 4 layers and the overrides, and the head build(target, *args) makes on it from seed 0."""
    out = {}
    for name, (family, overrides, *args) in cases.items():
        target = load_target(f"tiny:{family}", tiny={"num_hidden_layers": 4, **overrides})
        torch.manual_seed(0)
        head = build(target, *args)
        out[name] = target, head, export_record(head, target), export_state(head)
    return out
