"""scripts/cache_features.py + data.features=offline: same tokens and masks, features within storage precision."""

import json
from pathlib import Path

import pytest
import torch

from selfspec.core.errors import UserError
from selfspec.target.model import load_target
from selfspec.data.features import OfflineFeatures
from selfspec.scripts.cache_features import main as cache_main
from selfspec.methods.eagle.train import main as train_main
from tolerance import layers, tolerance, unit_roundoff

ROOT = Path(__file__).resolve().parents[2]



@pytest.mark.kernels  # two kernel paths compared (tests/tolerance.py); make test reruns it capped
def test_cache_then_train_offline(tmp_path):
    feats = tmp_path / "feats"
    summary = cache_main(["target=tiny-llama", "data=tiny", f"data.features_dir={feats}", "extra_layers=[1]",
                          "shard_tokens=5000"])
    index = json.loads((feats / "index.json").read_text())
    assert len(index["shards"]) > 1 and summary["bytes_per_token"] > 0
    target = load_target("tiny:llama")
    ds = OfflineFeatures(feats, target.identity)
    from selfspec.data.config import DataConfig
    from selfspec.data.tokenize import build_dataset
    from omegaconf import OmegaConf

    dcfg = OmegaConf.merge(OmegaConf.structured(DataConfig), OmegaConf.load(ROOT / "conf/data/tiny.yaml"))
    online = build_dataset(dcfg, target.tokenizer, "train")
    assert len(ds) == len(online)
    by_ids = {tuple(r["input_ids"]): r["loss_mask"] for r in online}
    row = ds[3]
    assert list(by_ids[tuple(row["input_ids"])]) == row["loss_mask"]
    exact = target.model.get_decoder()(input_ids=torch.tensor([row["input_ids"]])).last_hidden_state[0]
    # the cache's batched pass against this one (tests/tolerance.py), then one rounding to bf16 storage: u of the value
    cfg = target.model.config
    tol = tolerance(torch.float32, **layers(cfg, cfg.num_hidden_layers, positions=len(row["input_ids"]), ops=1),
                    scale=exact.abs().max())
    torch.testing.assert_close(row["features"].float(), exact, rtol=tol["rtol"] + unit_roundoff(torch.bfloat16),
                               atol=tol["atol"])
    result = train_main(["target=tiny-llama", "data=tiny", "data.features=offline", f"data.features_dir={feats}",
                         "train.max_steps=3", "train.eval_every=0", f"output_dir={tmp_path / 'run'}"])
    assert result["steps"] == 3


def test_features_for_another_target_are_refused(tmp_path):
    feats = tmp_path / "feats"
    cache_main(["target=tiny-llama", "data=tiny", f"data.features_dir={feats}", "data.max_conversations=20"])
    with pytest.raises(UserError, match="features cache is for target 'tiny:llama'"):
        OfflineFeatures(feats, load_target("tiny:qwen2").identity)


def test_missing_index_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match="no index.json"):
        OfflineFeatures(tmp_path, load_target("tiny:llama").identity)
