"""publish/peer_eagle.py (run by scripts/peer_eagle.py): the plumbing that lets SafeAILab/EAGLE's trainer run on
selfspec's data.

What EAGLE reads, from its source (eagle/train/main.py and eagle/model/cnets1.py at commit cb7e084): one
torch.save'd dict per sequence with `input_ids` [T], `hidden_state` [T, H] and `loss_mask` [T] (its ge_data scripts
write them); `lm_head.weight` and `model.embed_tokens.weight` looked up in the base folder's
`model.safetensors.index.json`; a head config whose `rope_theta` / `rope_scaling` EConfig and cnets1 read. The
end-to-end run needs a checkout of that repository and an interpreter with transformers 4.x (its own requirement):
set SELFSPEC_EAGLE_REPO and SELFSPEC_EAGLE_PYTHON to run the last test.
"""

import importlib.util
import json
import os
import types

import pytest
import torch
from safetensors.torch import load_file

from selfspec.core.errors import UserError
from selfspec.target.model import load_target
from selfspec.data.features import OfflineFeatures
from selfspec.publish import peer_eagle
from selfspec.scripts import cache_features
from selfspec.scripts import peer_eagle as script


@pytest.fixture(scope="module")
def target():
    return load_target("tiny:llama")


@pytest.fixture(scope="module")
def feats(tmp_path_factory):
    folder = tmp_path_factory.mktemp("peer") / "feats"
    cache_features.main(argv=["target=tiny-llama", "data=tiny", "data.max_conversations=6",
                              f"data.features_dir={folder}"])
    return folder


def test_head_config_speaks_econfig(target):
    cfg = peer_eagle.head_config(target.config)
    c = target.config
    assert cfg["num_hidden_layers"] == 1 and cfg["rope_scaling"] is None
    assert cfg["rope_theta"] == c.rope_parameters["rope_theta"]
    for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
              "rms_norm_eps"):
        assert cfg[k] == getattr(c, k), k


def test_head_config_refuses_rope_eagle_cannot_build(target):
    config = target.config.__class__.from_dict(target.config.to_dict())
    config.rope_parameters = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}
    with pytest.raises(UserError, match="default RoPE only"):
        peer_eagle.head_config(config)


def test_base_folder_holds_what_eagle_looks_up(target, tmp_path):
    peer_eagle.write_base(target, tmp_path / "base")
    index = json.loads((tmp_path / "base" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {"lm_head.weight", "model.embed_tokens.weight"}
    for key, file in index["weight_map"].items():
        tensor = load_file(str(tmp_path / "base" / file))[key]
        want = target.model.get_output_embeddings() if key == "lm_head.weight" else target.model.get_input_embeddings()
        assert torch.equal(tensor, want.weight.float()), key
    assert json.loads((tmp_path / "base" / "config.json").read_text())["hidden_size"] == target.config.hidden_size


def test_data_files_are_ge_data_layout(target, feats, tmp_path):
    cache = OfflineFeatures(feats, target.identity)
    tokens = peer_eagle.write_data(cache, tmp_path / "data")
    assert tokens == sum(len(cache[i]["input_ids"]) for i in range(len(cache)))
    assert len(list((tmp_path / "data").iterdir())) == len(cache)
    for i in (0, len(cache) - 1):
        row, saved = cache[i], torch.load(tmp_path / "data" / f"data_{i}.ckpt", weights_only=True)
        assert set(saved) == {"input_ids", "hidden_state", "loss_mask"}
        assert saved["input_ids"].tolist() == row["input_ids"] and saved["loss_mask"].tolist() == row["loss_mask"]
        assert saved["hidden_state"].dtype == torch.float32
        assert torch.equal(saved["hidden_state"], row["features"].float())


def test_patches_apply_exactly_as_counted():
    text = "".join(old * count for old, _, count in peer_eagle.PATCHES)
    patched = peer_eagle.patched_trainer(text)
    assert ".cuda()" not in patched and "_budget.tick(" in patched and "_budget.start()" in patched
    with pytest.raises(UserError, match="cb7e084"):
        peer_eagle.patched_trainer(text + ".cuda()")
    config = '    "num_warmup_steps": 2000,\n'
    assert '"num_warmup_steps": 50,' in peer_eagle.patched_trainer(text + config, warmup_steps=50)
    assert peer_eagle.patched_trainer(text + config) == patched + config  # its own schedule unless asked
    with pytest.raises(UserError, match="num_warmup_steps"):
        peer_eagle.patched_trainer(text, warmup_steps=50)


def test_checks_before_touching_anything(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    args = [f"eagle_repo={repo}", f"features_dir={tmp_path}", f"out={tmp_path / 'run'}", "target=tiny-llama"]
    with pytest.raises(SystemExit):
        script.main(argv=args)
    assert not (tmp_path / "run").exists()
    (tmp_path / "taken").mkdir()
    cfg = script.PeerEagleConfig(eagle_repo=str(repo), features_dir=str(tmp_path), out=str(tmp_path / "taken"))
    for path in (peer_eagle.TRAINER, peer_eagle.MODEL):
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text("")
    with pytest.raises(UserError, match="exists"):
        script.check(cfg)


def _budget(tmp_path, monkeypatch, minutes, every):
    monkeypatch.setenv("SELFSPEC_MINUTES", str(minutes))
    monkeypatch.setenv("SELFSPEC_SNAPSHOT_MINUTES", str(every))
    path = tmp_path / "selfspec_budget.py"
    path.write_text(peer_eagle.BUDGET)
    spec = importlib.util.spec_from_file_location("selfspec_budget_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_budget_snapshots_then_stops(tmp_path, monkeypatch):
    budget = _budget(tmp_path, monkeypatch, minutes=3, every=1)
    model = torch.nn.Linear(2, 2)
    acc = types.SimpleNamespace(is_main_process=True, unwrap_model=lambda m: m)
    batch = {"attention_mask": torch.ones(2, 5)}
    now = [1000.0]
    monkeypatch.setattr(budget.time, "time", lambda: now[0])
    budget.start()
    for minute in (0.5, 1.2, 2.5):
        now[0] = 1000.0 + 60 * minute
        budget.tick(acc, model, str(tmp_path / "ckpt"), batch)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["minute_1", "minute_2"]
    assert json.loads((tmp_path / "ckpt" / "minute_2" / "progress.json").read_text())["steps"] == 2
    now[0] = 1000.0 + 60 * 3
    with pytest.raises(SystemExit):
        budget.tick(acc, model, str(tmp_path / "ckpt"), batch)
    budget._at_exit()  # stopped by the budget: the exit hook writes nothing more
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["minute_1", "minute_2", "minute_3"]
    final = tmp_path / "ckpt" / "minute_3"
    progress = json.loads((final / "progress.json").read_text())
    assert progress == {"minute": 3, "seconds": 180.0, "steps": 3, "tokens": 30}
    assert torch.equal(load_file(str(final / "model.safetensors"))["weight"], model.weight)


def test_a_trainer_that_ends_inside_the_budget_leaves_its_final_head(tmp_path, monkeypatch):
    budget = _budget(tmp_path, monkeypatch, minutes=60, every=15)
    now = [0.0]
    monkeypatch.setattr(budget.time, "time", lambda: now[0])
    monkeypatch.setattr(budget.atexit, "register", lambda fn: None)
    budget.start()
    acc = types.SimpleNamespace(is_main_process=True, unwrap_model=lambda m: m)
    budget.tick(acc, torch.nn.Linear(2, 2), str(tmp_path / "ckpt"), {"attention_mask": torch.ones(1, 3)})
    now[0] = 90.0  # its epochs end at 1.5 minutes
    budget._at_exit()
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["minute_1.5"]
    assert json.loads((tmp_path / "ckpt" / "minute_1.5" / "progress.json").read_text())["steps"] == 1


@pytest.mark.skipif(not (os.environ.get("SELFSPEC_EAGLE_REPO") and os.environ.get("SELFSPEC_EAGLE_PYTHON")),
                    reason="needs a SafeAILab/EAGLE checkout (SELFSPEC_EAGLE_REPO) and its interpreter "
                           "(SELFSPEC_EAGLE_PYTHON)")
def test_eagle_trains_and_its_head_imports(feats, tmp_path):
    from selfspec.heads.checkpoint import load_head

    result = script.main(argv=["target=tiny-llama", f"eagle_repo={os.environ['SELFSPEC_EAGLE_REPO']}",
                                   f"features_dir={feats}", f"out={tmp_path / 'run'}", "minutes=0.2",
                                   "snapshot_minutes=0.1", f"python={os.environ['SELFSPEC_EAGLE_PYTHON']}"])
    minutes = [s["minute"] for s in result["snapshots"]]  # the tiny data may end all 20 epochs first: then its end
    assert minutes == sorted(minutes) and 0 < minutes[-1] <= 0.25 and result["snapshots"][-1]["steps"] > 0
    head = load_head(result["snapshots"][-1]["head"], load_target("tiny:llama"))
    assert head.fc.bias is not None and head.draft_vocab is None
