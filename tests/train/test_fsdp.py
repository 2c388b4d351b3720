"""FSDP2 end to end on two CPU processes: `train.fsdp=true` shards the head with torch's fully_shard over gloo
(accelerate runs FSDP only on GPUs). Every recipe trains, evaluates (an unsharded copy of the head on rank 0),
checkpoints, resumes to the same weights as an uninterrupted run, and exports the head a DDP run of the same seed
exports (within fp tolerance: FSDP reduce-scatters where DDP all-reduces). That DDP run is also each recipe's
two-process check: two gloo ranks that end on the same head, with a reduced draft vocabulary where the recipe builds
one on rank 0 and broadcasts it. The runs go through accelerate's test launcher forked from a warm Python
(`launch2`); EAGLE-3's DDP run also goes through a real `accelerate launch` (torchrun), which must end on the same
head bit for bit: what the fast launcher runs is what users launch."""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from harness.two_ranks import head_digests, real_launch

ROOT = Path(__file__).resolve().parents[2]
RUN = ["data=tiny", "data.max_conversations=24", "data.max_length=96", "train.max_steps=4", "train.save_every=2",
       "train.keep_last=0", "train.eval_every=2", "train.eval_prompts=1", "train.eval_new_tokens=8",
       "train.log_every=1", "logger=none"]
RECIPES = {
    "eagle": ["methods/eagle/train.py", "target=tiny-llama"],
    "eagle3": ["methods/eagle3/train.py", "target=tiny-llama", "ttt.steps=2",  # EAGLE-3's logits: its own lm_head
               "draft.vocab_size=64"],
    "dflash": ["methods/dflash/train.py", "target=tiny-llama", "draft.block_size=4", "draft.num_layers=2",
               "dflash.anchors=8", "draft.vocab_size=64"],  # context() and logits() run outside forward
    "layerskip": ["methods/layerskip/train.py", "target=tiny-llama", "+target.tiny.num_hidden_layers=4",
                  "draft.exit_layer=2", "draft.adapter=layer"],
}


def _entry(recipe: str, out: Path, *extra: str) -> list[str]:
    return [*RECIPES[recipe], *RUN, f"output_dir={out}", *extra]


# EAGLE-3 (a method outside forward reading the head's own lm_head, what failed on a GPU) runs by default, the other
# recipes under -m slow
@pytest.mark.parametrize("recipe", [r if r == "eagle3" else pytest.param(r, marks=pytest.mark.slow) for r in RECIPES])
def test_fsdp_trains_evaluates_resumes_and_exports_the_ddp_head(tmp_path, launch2, recipe):
    def _launch(recipe, out, *extra):
        return launch2(_entry(recipe, out, *extra), ROOT)

    full = _launch(recipe, tmp_path / "fsdp", "train.fsdp=true")
    assert full.returncode == 0, full.stderr[-3000:]
    assert len(head_digests(full)) == 1  # both ranks gathered the same whole head
    assert "[eval] step 2:" in full.stdout + full.stderr and "held-out" in full.stdout
    record = json.loads((tmp_path / "fsdp" / "head" / "config.json").read_text())
    assert record["training"]["sharded"] == ["head"] and "tau" in record["metrics"]

    # resume from the step-2 checkpoint (its whole head and optimizer state go back into the shards)
    part = tmp_path / "part"
    (part / "checkpoints").mkdir(parents=True)
    os.system(f"cp -r {tmp_path}/fsdp/checkpoints/step_00000002 {part}/checkpoints/")
    resumed = _launch(recipe, part, "train.fsdp=true")
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr[-3000:]
    assert head_digests(resumed) == head_digests(full)

    ddp = _launch(recipe, tmp_path / "ddp")
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    ranks = {line.split()[2] for line in ddp.stdout.splitlines() if "head sha256" in line}
    assert ranks == {"0", "1"} and len(head_digests(ddp)) == 1  # both DDP ranks end on the same head
    a, b = load_file(str(tmp_path / "fsdp" / "head" / "model.safetensors")), \
        load_file(str(tmp_path / "ddp" / "head" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)
    ddp_record = json.loads((tmp_path / "ddp" / "head" / "config.json").read_text())
    assert record["metrics"]["tau"] == ddp_record["metrics"]["tau"]
    if recipe == "eagle3":  # torchrun's ranks end where the fast launcher's did
        real = real_launch(_entry(recipe, tmp_path / "ddp_real"), ROOT)
        assert real.returncode == 0, real.stderr[-3000:]
        assert head_digests(real) == head_digests(ddp)


def test_a_sharded_target_holds_a_share_of_its_layers_per_process(tmp_path, launch2):
    """train.shard_target: the frozen target's decoder layers are FSDP units too; every rank evaluates in step."""
    run = launch2(_entry("layerskip", tmp_path / "run", "train.fsdp=true", "train.shard_target=true",
                         "train.max_steps=2"), ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(head_digests(run)) == 1
    record = json.loads((tmp_path / "run" / "head" / "config.json").read_text())["training"]
    assert record["sharded"] == ["head", "target"]
    assert record["target_param_mib_per_rank"] < record["target_param_mib_whole"]


def test_a_head_training_the_targets_own_weights_cannot_be_sharded(tmp_path, capsys):
    """A layerskip LoRA exit trains LoRA weights inside the target's layers: refused in one line, nothing written."""
    from selfspec.methods.layerskip.train import main

    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        main(RECIPES["layerskip"][1:] + RUN + ["draft.adapter=lora", "train.fsdp=true", f"output_dir={out}"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: this layerskip head cannot be sharded with FSDP"), err[-1]
    assert not out.exists()


def test_value_clipping_runs_under_accelerates_fsdp(monkeypatch):
    """accelerate's clip_grad_value_ refuses its FSDP distributed type (what stopped the first FSDP run on an H200):
    the optimizer step clamps the gradients itself, elementwise, as a rank's shard of them would be clamped."""
    from types import SimpleNamespace

    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    from selfspec.train.loop import optimizer_step

    acc = Accelerator(cpu=True)
    monkeypatch.setattr(type(acc), "distributed_type", property(lambda self: DistributedType.FSDP))
    head = torch.nn.Linear(4, 3)
    head.weight.grad = torch.tensor([[-2.0, 0.1, 3.0, -0.2]] * 3)
    head.bias.grad = torch.tensor([0.7, -0.9, 0.3])
    want = [head.weight.detach() - head.weight.grad.clamp(-0.5, 0.5), head.bias.detach() - torch.tensor([.5, -.5, .3])]
    run = SimpleNamespace(accelerator=acc, tc=SimpleNamespace(grad_clip_value=0.5), head_ddp=head,
                          optimizer=torch.optim.SGD(head.parameters(), lr=1.0))
    optimizer_step(run)
    torch.testing.assert_close([head.weight.detach(), head.bias.detach()], want)
    assert head.weight.grad is None  # dropped after the step
