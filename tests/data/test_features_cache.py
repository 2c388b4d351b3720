"""scripts/cache_features.py never loses a cache: bad options are refused before the folder is touched, a killed
run leaves the previous cache complete, and one run at a time writes a folder."""

import json

import pytest

from selfspec.target.model import load_target
from selfspec.data import feature_cache
from selfspec.data.features import OfflineFeatures
from selfspec.scripts.cache_features import main as cache_main

# ---------------------------------------------------------------------------------------------- no silent loss


def _files(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file() and p.name != ".selfspec.lock"}


CACHE = ["target=tiny-llama", "data=tiny", "data.max_conversations=12"]


@pytest.mark.parametrize("bad, message", [
    ("extra_layers=[99]", "extra_layers [99] outside 0..2"),
    ("data.max_length=4096", "data.max_length=4096 exceeds the target's context of 512"),
    ("shard_tokens=0", "shard_tokens and batch_size must be >= 1"),
])
def test_bad_options_keep_the_previous_cache(tmp_path, bad, message, capsys):
    feats = tmp_path / "feats"
    cache_main([*CACHE, f"data.features_dir={feats}"])
    before = _files(feats)
    with pytest.raises(SystemExit) as e:
        cache_main([*CACHE, f"data.features_dir={feats}", bad])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and message in err, err
    assert _files(feats) == before


def test_a_killed_run_keeps_the_previous_cache_and_the_next_run_cleans_up(tmp_path, monkeypatch):
    feats = tmp_path / "feats"
    cache_main([*CACHE, f"data.features_dir={feats}", "shard_tokens=300"])
    before = _files(feats)
    real, calls = feature_cache.write_shard, []

    def dies_on_the_second_shard(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(feature_cache, "write_shard", dies_on_the_second_shard)
    with pytest.raises(SystemExit):
        cache_main([*CACHE, f"data.features_dir={feats}", "shard_tokens=300", "extra_layers=[1]"])
    assert {k: v for k, v in _files(feats).items() if k in before} == before  # old index and shards intact
    OfflineFeatures(feats, load_target("tiny:llama").identity)  # still a complete cache
    monkeypatch.setattr(feature_cache, "write_shard", real)
    cache_main([*CACHE, f"data.features_dir={feats}", "shard_tokens=300", "extra_layers=[1]"])
    index = json.loads((feats / "index.json").read_text())
    # no leftovers
    assert sorted(_files(feats)) == sorted(["index.json", "config.yaml", *(s["file"] for s in index["shards"])])
    assert len(OfflineFeatures(feats, load_target("tiny:llama").identity, layers=[1])) > 0


def test_a_second_run_on_the_folder_is_refused(tmp_path, capsys):
    from selfspec.core.atomic import acquire_lock

    feats = tmp_path / "feats"
    lock = acquire_lock(feats)  # another run holds it
    try:
        with pytest.raises(SystemExit) as e:
            cache_main([*CACHE, f"data.features_dir={feats}"])
    finally:
        lock.release()
    assert e.value.code == 2 and "in use by another selfspec run" in capsys.readouterr().err
    assert not (feats / "index.json").exists()
