"""Features and regenerated data from vLLM (target/vllm_worker.py), without vLLM: a fake worker (fake_vllm_worker.py)
speaks the same protocol with vLLM's conventions computed by transformers, so these tests check selfspec's side --
the peers' traps (layer ids, the final norm, token ids, states cut short) and the one-line refusals. The real
comparison against vLLM is scripts/check_vllm_features.py (`make check-vllm-features`), not a test."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from selfspec.target import vllm_worker
from selfspec.core.errors import UserError
from selfspec.target.model import load_target
from selfspec.data.features import OfflineFeatures, engine_features, engine_layers
from selfspec.scripts.cache_features import main as cache_main
from harness.warm_exec import WarmExecutable
from tolerance import layers, tolerance, unit_roundoff

FAKE = Path(__file__).with_name("fake_vllm_worker.py")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """tiny:llama saved as an HF folder: what vLLM (here, the fake) loads."""
    folder = tmp_path_factory.mktemp("tiny_llama")
    target = load_target("tiny:llama")
    target.model.save_pretrained(folder)
    target.tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def vllm_python():
    """The `python` the fake worker is started with: each start a fork of one warm Python that has imported torch
    and transformers (harness/warm_exec.py), not a fresh interpreter importing them for seconds."""
    with WarmExecutable(dict(os.environ, HF_HUB_OFFLINE="1")) as python:
        yield str(python.path)


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(vllm_worker, "WORKER", FAKE)
    for name in ("FAKE_VLLM_VERSION", "FAKE_VLLM_SHORT", "FAKE_VLLM_TOKENS", "FAKE_VLLM_FAIL"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _vllm_like(model, ids, layers):
    """vLLM's columns for `layers` (sorted): HF hidden_states[k], but the last layer's state before the norm."""
    last = {}
    hook = model.get_decoder().layers[-1].register_forward_hook(
        lambda mod, args, out: last.update(h=out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        out = model.get_decoder()(input_ids=ids, output_hidden_states=True)
    hook.remove()
    n = len(out.hidden_states) - 1
    return out, torch.stack([last["h"][0] if k == n else out.hidden_states[k][0] for k in layers], dim=1)


def test_engine_features_read_vllm_ids_as_hf_hidden_states_and_add_the_final_norm():
    target = load_target("tiny:llama")
    model, n = target.model, target.identity["num_hidden_layers"]
    layers = engine_layers([2, 0, 1, 0], n)
    assert layers == [0, 1, 2]  # sorted, no repeats, the last layer always there (vLLM's aux order)
    ids = torch.tensor([[5, 9, 3, 7, 1]])
    hf, states = _vllm_like(model, ids, layers)
    got = engine_features(states, layers, n, model.get_decoder().norm, torch.float32, [2, 0, 1])
    torch.testing.assert_close(got["features"], hf.last_hidden_state[0], rtol=0, atol=0)
    for k in (0, 1, 2):  # vLLM id k = HF hidden_states[k] (the output of HF layer k-1), the norm on k = n
        torch.testing.assert_close(got[f"layer_{k}"], hf.hidden_states[k][0], rtol=0, atol=0)
    # the traps, shown: vLLM's last column is not HF's last state, and id k is not HF layer index k's output
    assert not torch.allclose(states[:, 2], hf.hidden_states[2][0], atol=1e-3)
    assert not torch.allclose(states[:, 1], hf.hidden_states[2][0], atol=1e-3)


def test_cache_features_from_the_fake_vllm_equals_the_hf_cache(tmp_path, tiny_folder, fake, vllm_python):
    common = [f"target.name_or_path={tiny_folder}", "data=tiny", "data.max_conversations=6", "extra_layers=[2,0,1]"]
    cache_main([*common, f"data.features_dir={tmp_path / 'hf'}"])
    summary = cache_main([*common, f"data.features_dir={tmp_path / 'vllm'}", "engine=vllm", "batch_size=4",
                          f"vllm_python={vllm_python}"])
    assert summary["engine"] == "vllm" and summary["vllm"] == "0.32.0"
    identity = load_target(str(tiny_folder)).identity
    hf = OfflineFeatures(tmp_path / "hf", identity, layers=[0, 1, 2])
    ours = OfflineFeatures(tmp_path / "vllm", identity, layers=[0, 1, 2])
    assert len(hf) == len(ours) == summary["sequences"] > 1
    cfg = load_target(str(tiny_folder)).model.config
    for a, b in zip(hf, ours):
        assert a["input_ids"] == b["input_ids"] and a["loss_mask"] == b["loss_mask"]
        # the two engines' fp32 states differ in the last bits (another batch, another GEMM: tests/tolerance.py's
        # bound for the layers and the final norm), then each is rounded to bf16 storage, within u of the value: where
        # one lies on a bf16 rounding boundary they are stored one bf16 step apart (0.03125 at |x| in [4, 8), seen
        # with oneDNN capped at SSE4.1)
        span = layers(cfg, cfg.num_hidden_layers, positions=len(a["input_ids"]), ops=1)
        for key in ("features", "layer_0", "layer_1", "layer_2"):
            tol = tolerance(torch.float32, **span, scale=b[key].float().abs().max())
            torch.testing.assert_close(a[key].float(), b[key].float(), atol=tol["atol"],
                                       rtol=tol["rtol"] + 2 * unit_roundoff(torch.bfloat16))
    assert json.loads((tmp_path / "vllm" / "index.json").read_text())["target"] == identity


@pytest.mark.parametrize("env, message", [
    ("FAKE_VLLM_TOKENS", "token ids for prompt 0 differ from selfspec's at position 1"),
    ("FAKE_VLLM_SHORT", "chunked prefill or prefix caching on"),
    ("FAKE_VLLM_FAIL", "vLLM (start) failed: RuntimeError: no CPU for you"),
])
def test_the_worker_guards_refuse_in_one_line(tiny_folder, fake, vllm_python, env, message):
    fake.setenv(env, "1")
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        with vllm_worker.VllmWorker(vllm_python, str(tiny_folder), max_model_len=64, layers=[2, 0]) as w:
            w.hidden_states([[1, 5, 9, 4]])


@pytest.mark.parametrize("version, message", [
    ("none", "no vLLM installed for"),
    ("0.10.2", "vLLM 0.10.2 at .* is older than 0.32.0"),
])
def test_a_missing_or_old_vllm_is_refused_before_anything_runs(fake, version, message):
    fake.setenv("FAKE_VLLM_VERSION", version)
    with pytest.raises(UserError, match=message):
        vllm_worker.check_vllm_python(sys.executable)
    with pytest.raises(UserError, match="no vLLM venv at '/nonexistent/python'"):
        vllm_worker.check_vllm_python("/nonexistent/python")


def test_versions_compare_as_numbers():
    assert vllm_worker._parse("0.32.0+cpu") == (0, 32, 0) > vllm_worker._parse("0.9.2") == (0, 9, 2)
    assert vllm_worker._parse("0.33.0rc1") >= vllm_worker.MIN_VERSION


def test_cache_features_engine_vllm_refusals_leave_nothing(tmp_path, fake, capsys):
    fake.setenv("FAKE_VLLM_VERSION", "0.8.0")
    feats = tmp_path / "feats"
    for args, message in (([f"vllm_python={sys.executable}", "target=tiny-llama"], "older than 0.32.0"),
                          (["vllm_python=/nonexistent/python", "target=tiny-llama"], "no vLLM venv at"),
                          (["engine=sglang", "target=tiny-llama"], "engine must be one of hf, vllm")):
        with pytest.raises(SystemExit) as e:
            cache_main(["data=tiny", f"data.features_dir={feats}", "engine=vllm", *args])
        assert e.value.code == 2 and message in capsys.readouterr().err.strip().splitlines()[-1]
        assert not feats.exists()
    fake.setenv("FAKE_VLLM_VERSION", "0.32.0")
    with pytest.raises(SystemExit):
        cache_main(["data=tiny", f"data.features_dir={feats}", "engine=vllm", f"vllm_python={sys.executable}",
                    "target=tiny-llama"])
    assert "has no local HF folder for vLLM" in capsys.readouterr().err and not feats.exists()


def test_regenerate_engine_vllm_writes_what_hf_writes_at_greedy(tmp_path, tiny_folder, fake, vllm_python):
    from selfspec.scripts.regenerate import main as regen_main

    common = [f"target.name_or_path={tiny_folder}", "data=tiny", "data.max_conversations=4", "max_new_tokens=6",
              "max_turns=1"]
    hf = regen_main([*common, f"out={tmp_path / 'hf.jsonl'}"])
    ours = regen_main([*common, f"out={tmp_path / 'vllm.jsonl'}", "engine=vllm", f"vllm_python={vllm_python}"])
    assert ours["engine"] == "vllm" and ours["written"] == hf["written"] > 0 and ours["tokens"] == hf["tokens"]
    assert (tmp_path / "hf.jsonl").read_text() == (tmp_path / "vllm.jsonl").read_text()
    again = regen_main([*common, f"out={tmp_path / 'vllm.jsonl'}", "engine=vllm", f"vllm_python={vllm_python}"])
    assert again["resumed"] == ours["written"] and again["written"] == 0  # resumable as the HF path
    with pytest.raises(SystemExit):  # another engine is another run: refused, naming the key
        regen_main([*common, f"out={tmp_path / 'vllm.jsonl'}"])


def test_training_streams_features_from_the_fake_vllm(tmp_path, tiny_folder, fake, vllm_python):
    """data.features=vllm: the rows read like a features cache's (bf16 HF values), a recipe trains from them, and
    the worker stops when the run ends (not at the process's exit: a real one holds an engine's memory)."""
    import psutil

    from selfspec.methods.eagle3.train import main as train_main

    out = train_main([f"target.name_or_path={tiny_folder}", "data=tiny", "data.max_conversations=8",
                      "data.features=vllm", f"data.vllm_python={vllm_python}", "train.max_steps=2",
                      "train.eval_every=0", "train.eval_prompts=0", f"output_dir={tmp_path / 'run'}"])
    assert (tmp_path / "run" / "head").is_dir(), out
    workers = [p for p in psutil.Process().children() if str(FAKE) in " ".join(p.cmdline())]
    assert psutil.wait_procs(workers, timeout=30)[1] == [], "the vLLM worker outlived its run"


def test_engine_features_rows_equal_hf_rows(tiny_folder, fake, vllm_python):
    from selfspec.data.features import EngineFeatures

    target = load_target(str(tiny_folder))
    rows = [{"input_ids": [1, 5, 9, 4, 7], "loss_mask": [0, 0, 1, 1, 1]}]
    with vllm_worker.VllmWorker(vllm_python, str(tiny_folder), max_model_len=64, layers=engine_layers([1], 2)) as w:
        got = EngineFeatures(rows, w, [1], 2, target.model.get_decoder().norm)[0]
    with torch.no_grad():
        hf = target.model.get_decoder()(input_ids=torch.tensor([rows[0]["input_ids"]]), output_hidden_states=True)
    assert got["input_ids"] == rows[0]["input_ids"] and got["loss_mask"] == rows[0]["loss_mask"]
    torch.testing.assert_close(got["features"], hf.last_hidden_state[0].to(torch.bfloat16), rtol=0, atol=0)
    torch.testing.assert_close(got["layer_1"], hf.hidden_states[1][0].to(torch.bfloat16), rtol=0, atol=0)


def test_the_worker_asks_vllm_for_whole_prompts_and_sorted_layers(monkeypatch):
    """What target/vllm_worker.py hands vLLM's LLM(): chunked prefill and prefix caching off (a prompt's states from
    one forward pass over all of it), its ids sorted (vLLM's aux order), the synchronous connector."""
    import types

    seen = {}
    fake_vllm = types.ModuleType("vllm")
    fake_vllm.LLM = lambda **kw: seen.update(kw) or "llm"
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm)
    monkeypatch.setattr(vllm_worker, "_connector_class", lambda: object)
    monkeypatch.setattr(vllm_worker, "SelfspecHiddenStatesConnector", None, raising=False)
    spec = {"target": "/t", "max_model_len": 99, "layers": [30, 2, 15, 2], "storage": "/s"}
    assert vllm_worker._build_llm(spec) == "llm"
    assert seen["enable_chunked_prefill"] is False and seen["enable_prefix_caching"] is False
    assert seen["max_num_batched_tokens"] == 99  # the longest prompt fits one engine step
    hf_config = seen["speculative_config"]["draft_model_config"]["hf_config"]
    assert seen["speculative_config"]["method"] == "extract_hidden_states"
    assert hf_config["eagle_aux_hidden_state_layer_ids"] == [2, 15, 30]
    kv = seen["kv_transfer_config"]
    assert kv["kv_connector"] == "SelfspecHiddenStatesConnector"
    assert kv["kv_connector_module_path"] == vllm_worker.__name__  # found in the worker's own module
    assert kv["kv_connector_extra_config"]["shared_storage_path"] == "/s"
