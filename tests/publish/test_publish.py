"""Publishing heads: the staged folder and its card, the upload calls (intercepted at HfApi, or against a stub
Hub on 127.0.0.1), one-line errors, and loading a head by Hub id from the cache with HF_HUB_OFFLINE."""

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import huggingface_hub
import pytest
import torch
from huggingface_hub import ModelCard, constants

from selfspec.heads.checkpoint import head_record, load_head, read_head, save_head
from selfspec.methods.dflash.head import build_dflash
from selfspec.methods.eagle.head import build_eagle
from selfspec.methods.eagle3.head import build_eagle3
from selfspec.methods.layerskip.head import build_layerskip
from selfspec.core.errors import UserError
from selfspec.publish.card import model_card
from selfspec.publish.hub import UPLOADED, stage, upload
from selfspec.target.model import load_target
from selfspec.scripts import publish as publish_script

REPO = "someone/tiny-eagle"


@pytest.fixture(scope="module")
def target():
    return load_target("tiny:llama")


@pytest.fixture()
def head_dir(tmp_path, target):
    torch.manual_seed(0)
    head = build_eagle(target.model)
    training = {"recipe": "methods/eagle/train.py", "data": {"path": "synthetic", "max_length": 256}, "steps": 5,
                "train": {"lr": 3e-4}, "final_loss": 4.2, "final_acc": 0.1}
    return save_head(head, tmp_path / "run" / "head",
                     head_record(head, target.identity, training=training, metrics={"tau": 1.31, "acc_0": 0.25}))


def _outputs(head, target):
    """Head outputs and logits on fixed inputs: the draft a decoder would see."""
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(1, 6, target.config.hidden_size, generator=g)
    ids = torch.randint(0, 256, (1, 6), generator=g)
    with torch.no_grad():
        out = head(feats, ids, torch.arange(6)[None])
        return out, head.logits(out)


def _same_outputs(a, b, target):
    (ha, la), (hb, lb) = _outputs(a, target), _outputs(b, target)
    return torch.equal(ha, hb) and torch.equal(la, lb)


# ---------------------------------------------------------------------------------------------- staging + card


def test_dry_run_folder_loads_back_identically(tmp_path, head_dir, target):
    main = publish_script.main

    out = tmp_path / "staged"
    result = main([f"head={head_dir}", f"repo_id={REPO}", "dry_run=true", f"out={out}"])
    assert result["files"] == sorted(UPLOADED) == sorted(p.name for p in out.iterdir())
    assert (out / "model.safetensors").read_bytes() == (head_dir / "model.safetensors").read_bytes()
    assert _same_outputs(load_head(str(out), target), load_head(str(head_dir), target), target)


def test_card_metadata_and_tables_for_the_embedded_target(head_dir):
    record = json.loads((head_dir / "config.json").read_text())
    record["target"]["name_or_path"] = "embedded:smollm2-135m"
    bench = {"target": "embedded:smollm2-135m", "methods": {
        "none": {"tau": 1.0, "tokens_per_s": 14.0, "speedup": 1.0, "identical": True},
        "eagle": {"tau": 1.9, "tokens_per_s": 19.6, "speedup": 1.4, "identical": True}}}
    _, state = read_head(str(head_dir))
    card = model_card(record, REPO, state, bench)
    meta = card.split("---")[1]
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in meta and "license: apache-2.0" in meta
    assert "library_name: selfspec" in meta
    assert all(f"- {t}" in meta for t in ("speculative-decoding", "eagle", "draft-model"))
    data = ModelCard(card).data  # what the Hub reads: huggingface_hub's own parser
    assert (data.base_model, data.license, data.library_name, data.pipeline_tag) == (
        "HuggingFaceTB/SmolLM2-135M-Instruct", "apache-2.0", "selfspec", "text-generation")
    assert data.eval_results is None and "model-index" not in card
    assert "| eagle | 1.90 | 19.6 | 1.40x | yes |" in card
    assert f"python decode/generate.py head={REPO}" in card and "scripts/export.py" in card
    n = sum(v.numel() for k, v in state.items() if k != "model.embed_tokens.weight")
    assert "methods/eagle/train.py" in card and "synthetic" in card and f"{n:,} trained parameters" in card


def test_card_falls_back_to_training_metrics_and_omits_unknown_license(head_dir):
    record, state = read_head(str(head_dir))
    card = model_card(record, REPO, state)
    assert "tau 1.31" in card and "base_model" not in card and "license:" not in card.split("---")[1]
    assert ModelCard(card).data.base_model is None and ModelCard(card).data.license is None


def test_card_reads_bench_json_beside_the_head(tmp_path, head_dir):
    (head_dir.parent / "bench.json").write_text(json.dumps({"methods": {"eagle": {"tau": 2.5, "speedup": 1.7}}}))
    folder = stage(str(head_dir), tmp_path / "s", REPO)
    assert "| eagle | 2.50 | - | 1.70x | - |" in (folder / "README.md").read_text()


SERVING = {"date": "2026-11-24", "machine": "AMD EPYC 9R14, 2 CPUs", "threads": 2, "prompts": 12,
           "heldout_prompts": 8, "code_prompts": 4, "max_new_tokens": 128, "num_draft": 3,
           "llamacpp_args": ["--no-repack"], "llamacpp_head_args": ["-td", "1"], "engines": {"llama.cpp F32": {}},
           "failed": {"q8_0": "llama-server exited -11: 0.00.004 I srv load_model: loading model 'target-q8_0.gguf'"},
           "table": "| engine | method | tok/s | tau | speedup | identical to plain |\n|---|---|---|---|---|---|\n"
                    "| llama.cpp F32 | plain | 70.0 | 1.00 | 1.00x | 12/12 |\n"
                    "| llama.cpp F32 | eagle3 head | 80.5 | 2.30 | 1.15x | 12/12 |\n"}


def test_card_shows_the_serving_engines_table(tmp_path, head_dir):
    (tmp_path / "serve.json").write_text(json.dumps(SERVING))
    card = (stage(str(head_dir), tmp_path / "s", REPO, serving=str(tmp_path / "serve.json")) / "README.md").read_text()
    section = card.split("## In serving engines", 1)[1].split("\n## ", 1)[0]
    assert "| llama.cpp F32 | eagle3 head | 80.5 | 2.30 | 1.15x | 12/12 |" in section
    assert ("on 2026-11-24, on AMD EPYC 9R14, 2 CPUs, 2 threads, 12 prompts (8 held-out, 4 code), 128 new tokens"
            in section)
    assert "Not measured: q8_0 (llama-server exited -11)." in section
    assert "chain of 3, every llama.cpp row with `--no-repack`, llama.cpp head rows with `-td 1`" in section
    assert "No speed benchmark yet" not in card
    assert "## In serving engines" not in (stage(str(head_dir), tmp_path / "t", REPO) / "README.md").read_text()


@pytest.mark.parametrize("content", ["{not json", json.dumps({"methods": {}})])
def test_a_serving_file_that_is_not_serve_bench_output_is_refused_before_writing(tmp_path, head_dir, content):
    (tmp_path / "serve.json").write_text(content)
    with pytest.raises(UserError, match=r"serving file .*(unreadable|not scripts/serve_bench.py's output)"):
        stage(str(head_dir), tmp_path / "s", REPO, serving=str(tmp_path / "serve.json"))
    assert not (tmp_path / "s").exists()


def test_reduced_vocab_and_bias_heads_point_to_sglang(target, tmp_path):
    head = build_eagle(target.model, fc_bias=True, vocab_size=32, draft_vocab=torch.arange(32))
    folder = save_head(head, tmp_path / "h", head_record(head, target.identity))
    card = (stage(str(folder), tmp_path / "s", REPO) / "README.md").read_text()
    assert "vLLM's EAGLE-1 loader cannot express" in card and "--speculative-token-map" in card
    assert "format=eagle" not in card


def _staged_card(head, target, tmp_path, **record):
    """The README.md staged for `head`, parsed by huggingface_hub: (metadata dict, body, the head's state)."""
    folder = save_head(head, tmp_path / "h", head_record(head, target.identity, **record))
    card = ModelCard((stage(str(folder), tmp_path / "s", REPO) / "README.md").read_text())
    return card.data.to_dict(), card.text, read_head(str(folder))[1]


def _lists_every_tensor(body, state):
    """The tensor table is the weights file's own: every name with its shape (one-layer heads: no grouping)."""
    return all(f"| `{k}` | {list(v.shape)} | {str(v.dtype).removeprefix('torch.')} |" in body for k, v in state.items())


def test_eagle_card_describes_fc_2h_to_h_and_its_layer(target, tmp_path):
    meta, body, state = _staged_card(build_eagle(target.model), target, tmp_path)
    assert meta["library_name"] == "selfspec" and meta["pipeline_tag"] == "text-generation"
    assert "eagle" in meta["tags"] and "eagle3" not in meta["tags"] and "speculative-decoding" in meta["tags"]
    assert "base_model" not in meta and "license" not in meta  # a tiny target has no Hub id
    assert "| fc | 128 -> 64 (2H -> H), no bias |" in body and "| decoder layers | 1 (llama family) |" in body
    assert "the target's full vocabulary (320)" in body and _lists_every_tensor(body, state)
    assert f"selfspec generate head={REPO} target=tiny-llama" in body and "drafter=" not in body
    assert "format=eagle " in body and "format=gguf" not in body


def test_eagle3_card_names_its_aux_layers_and_reduced_vocabulary(target, tmp_path):
    head = build_eagle3(target.model, aux_layers=[0, 1, 1], vocab_size=32, draft_vocab=torch.arange(32))
    training = {"recipe": "methods/eagle3/train.py", "steps": 7, "train_seconds": 90.0, "init_train_seconds": 300.0,
                "heldout": {"tau": 1.75, "chains": 12}}
    meta, body, state = _staged_card(head, target, tmp_path, training=training, metrics={"tau": 1.75})
    assert "eagle3" in meta["tags"]
    assert "| aux layers | [0, 1, 1]" in body and "fc(cat(A_0, A_1, A_1))" in body
    assert "| fc | 192 -> 64 (3 aux layers x H, no bias) |" in body and "2H -> H" not in body
    assert "q/k/v over 128 (2H) inputs" in body and "32 of the target's 320 tokens" in body
    assert "| `d2t` | [32] | int64 |" in body and "| `t2d` | [320] | bool |" in body
    assert _lists_every_tensor(body, state)
    assert "steps 7" in body and "minutes 1.5" in body and "held-out tau 1.75 over 12 chains" in body
    assert "minutes before, in the head it continued 5.0" in body
    assert f"selfspec generate head={REPO} drafter=eagle3" in body
    assert all(f"format={f}" in body for f in ("sglang", "gguf")) and "format=eagle " not in body
    assert "format=speculators" not in body  # [0, 1, 1] reads layer 1 twice: vLLM collects each layer once


@pytest.mark.parametrize("adapter", ["light", "layer", "lora"])
def test_layerskip_card_names_its_exit_and_adapter(target, tmp_path, adapter):
    head = build_layerskip(target.model, exit_layer=1, adapter=adapter, rank=4)
    meta, body, state = _staged_card(head, target, tmp_path)
    assert "layerskip" in meta["tags"] and "eagle" not in meta["tags"]
    assert "| exit layer | 1 of 2 decoder layers" in body and f"| adapter | `{adapter}`: " in body
    assert "fc(" not in body and "| fc |" not in body and _lists_every_tensor(body, state)
    reuse = "all the target's layers" if adapter == "lora" else "reuses the draft pass's keys/values of layers 0..0"
    assert reuse in body and ("rank 4" in body) == (adapter == "light")
    assert f"selfspec generate head={REPO} drafter=layerskip" in body
    assert "No serving-engine export" in body and "selfspec export" not in body


def test_staging_refuses_a_folder_with_other_files(tmp_path, head_dir):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("x")
    with pytest.raises(UserError, match="holds other files"):
        stage(str(head_dir), tmp_path / "busy", REPO)


def test_not_a_head_is_refused_before_anything_is_written(tmp_path):
    (tmp_path / "x").mkdir()
    with pytest.raises(UserError, match="not a head folder"):
        stage(str(tmp_path / "x"), tmp_path / "s", REPO)
    assert not (tmp_path / "s").exists()


# ---------------------------------------------------------------------------------------------- upload calls


def test_upload_sends_exactly_the_staged_files(tmp_path, head_dir, monkeypatch):
    main = publish_script.main

    calls = {}

    def create_repo(self, repo_id, **kw):
        calls["create_repo"] = (repo_id, kw)

    def create_branch(self, repo_id, **kw):
        calls["create_branch"] = (repo_id, kw)

    def upload_folder(self, **kw):
        calls["upload_folder"] = dict(kw, files=sorted(p.name for p in Path(kw["folder_path"]).iterdir()),
                                      token=self.token)
        return huggingface_hub.CommitInfo(commit_url=f"https://huggingface.co/{kw['repo_id']}/commit/abc",
                                          commit_message="", commit_description="", oid="abc")

    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "create_branch", create_branch)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
    result = main([f"head={head_dir}", f"repo_id={REPO}", "private=true", "revision=v1", "commit_message=first head"])
    assert calls["create_repo"] == (REPO, {"private": True, "exist_ok": True})
    assert calls["create_branch"] == (REPO, {"branch": "v1", "exist_ok": True})
    up = calls["upload_folder"]
    assert (up["repo_id"], up["revision"], up["commit_message"]) == (REPO, "v1", "first head")
    assert up["files"] == sorted(UPLOADED) and sorted(up["allow_patterns"]) == sorted(UPLOADED)
    assert up["token"] == "hf_test_token"
    assert result["commit"].endswith("/commit/abc") and not Path(up["folder_path"]).exists()  # temp staging removed


def test_no_token_is_one_line(monkeypatch, tmp_path, head_dir, capsys):
    main = publish_script.main

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    with pytest.raises(SystemExit) as e:
        main([f"head={head_dir}", f"repo_id={REPO}"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "hf auth login" in err and "HF_TOKEN" in err


class _StubHub(BaseHTTPRequestHandler):
    """Answers every request with the status the test sets, like the Hub does (JSON error body)."""

    status = 403
    seen: list = []

    def _reply(self):
        type(self).seen.append((self.command, self.path))
        body = json.dumps({"error": "You don't have the rights to create a model under the namespace"}).encode()
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        if self.status in (401, 404):  # what the Hub sends for a missing or private repo
            self.send_header("X-Error-Code", "RepoNotFound")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = _reply

    def log_message(self, *args):
        pass


@pytest.fixture()
def stub_hub(monkeypatch):
    server = HTTPServer(("127.0.0.1", 0), _StubHub)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    _StubHub.seen = []
    yield _StubHub
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("status,expected", [(401, "rejected the token"), (403, "no write access"),
                                             (500, "answered 500")])
def test_hub_http_errors_are_one_line(stub_hub, tmp_path, head_dir, status, expected):
    stub_hub.status = status
    folder = stage(str(head_dir), tmp_path / "s", REPO)
    with pytest.raises(UserError) as e:
        upload(folder, REPO)
    assert expected in str(e.value) and "\n" not in str(e.value) and REPO in str(e.value)
    assert ("POST", "/api/repos/create") in stub_hub.seen


def test_network_failure_is_one_line_and_says_rerun_is_safe(monkeypatch, tmp_path, head_dir):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    folder = stage(str(head_dir), tmp_path / "s", REPO)
    with pytest.raises(UserError, match="cannot upload to the Hub.*idempotent") as e:
        upload(folder, REPO)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------- loading by id


def _populate_cache(cache: Path, repo_id: str, files_from: Path, commit: str = "a" * 40) -> Path:
    """The layout huggingface_hub's cache has after a download: refs/main -> snapshots/<commit>/<files>."""
    repo_dir = cache / f"models--{repo_id.replace('/', '--')}"
    snap = repo_dir / "snapshots" / commit
    snap.mkdir(parents=True)
    for p in files_from.iterdir():
        (snap / p.name).write_bytes(p.read_bytes())
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    return snap


def test_load_by_hub_id_offline_from_the_cache(tmp_path, head_dir, target, monkeypatch):
    staged = stage(str(head_dir), tmp_path / "staged", REPO)
    _populate_cache(tmp_path / "hub", REPO, staged)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    loaded = load_head(REPO, target)
    assert _same_outputs(loaded, load_head(str(head_dir), target), target)
    assert loaded.record["head"]["type"] == "eagle"


def test_load_by_hub_id_offline_not_cached_is_one_line(tmp_path, target, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UserError, match="not cached.*HF_HUB_OFFLINE") as e:
        load_head("someone/never-downloaded", target)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("status,expected", [(401, "not found \\(or private"), (404, "not found \\(or private"),
                                             (403, "answered 403.*hf auth login")])
def test_load_by_hub_id_http_errors_are_one_line(stub_hub, tmp_path, target, monkeypatch, status, expected):
    stub_hub.status = status
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(UserError, match=expected) as e:
        load_head("someone/private-head", target)
    assert "\n" not in str(e.value)


def test_load_by_hub_id_network_down_is_one_line(tmp_path, target, monkeypatch):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(UserError, match="cannot be reached") as e:
        load_head("someone/any-head", target)
    assert "\n" not in str(e.value)


def test_bad_hub_id_is_one_line(target):
    with pytest.raises(UserError) as e:
        load_head("some one/bad--name", target)
    assert "\n" not in str(e.value)


def test_a_failed_staging_leaves_the_previous_folder_as_it_was(tmp_path, head_dir, target):
    staged = stage(str(head_dir), tmp_path / "s", REPO)
    before = {p.name: p.read_bytes() for p in staged.iterdir()}
    other = save_head(build_eagle(target.model, fc_bias=True), tmp_path / "other" / "head",
                      head_record(build_eagle(target.model, fc_bias=True), target.identity))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(UserError, match="bench file .* is unreadable"):
        stage(str(other), staged, REPO, bench=str(tmp_path / "bad.json"))
    assert {p.name: p.read_bytes() for p in staged.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp folder left


def test_dflash_card_names_its_block_layers_and_engines(target, tmp_path):
    head = build_dflash(target.model, block_size=4, num_layers=1, target_layer_ids=[0])
    meta, body, state = _staged_card(head, target, tmp_path)
    assert "dflash" in meta["tags"] and "eagle" not in meta["tags"]
    assert "| block size | 4: the anchor (last committed token) and 3 drafted tokens |" in body
    assert "| target layer ids | [0] (decoder layer i's OUTPUT = HF `hidden_states[i + 1]`" in body
    assert "| fc | 64 -> 64 (1 layers x H, no bias), then `hidden_norm` |" in body and _lists_every_tensor(body, state)
    assert "format=speculators" in body and '"num_speculative_tokens": 3' in body
    assert "--spec-type draft-dflash --spec-draft-n-max 3" in body


def test_reduced_vocabulary_dflash_card_offers_no_engine(target, tmp_path):
    head = build_dflash(target.model, block_size=4, num_layers=1, vocab_size=32, draft_vocab=torch.arange(32))
    _, body, _ = _staged_card(head, target, tmp_path)
    assert "32 of the target's 320 tokens" in body and "format=" not in body
    assert "need the draft's own lm_head rows" in body


def test_card_lists_acceptance_in_position_order():
    """acc@10 sorts before acc@2 as text: the card orders positions by number (a block head has 15 of them)."""
    from selfspec.publish.card import _results_lines

    metrics = {"tau": 1.5, **{f"acc@{i}": i / 100 for i in range(1, 12)}}
    line = _results_lines(metrics, None)[0]
    assert "acceptance by position " + " ".join(f"{i / 100:.2f}" for i in range(1, 12)) in line


def test_card_reads_the_loss_knobs_from_the_recipes_group():
    """A head's training record keeps its loss under the recipe's group (`eagle`, `layerskip`); heads trained before
    the knobs left `train` keep them there. The card names them either way, and none for a recipe without them."""
    from selfspec.publish.card import _training_lines

    def hyper_parameters(training: dict) -> str:
        return next(line for line in _training_lines(training) if line.startswith("- hyper-parameters"))

    train, knobs = {"lr": 0.001, "batch_size": 4}, {"w_feat": 1.0, "w_tok": 0.1, "noise_std": 0.2}
    for training in ({"train": train, "eagle": knobs}, {"train": train, "layerskip": knobs},
                     {"train": {**train, **knobs}}):  # the last: a head trained before the knobs moved
        assert "lr 0.001, batch 4, w_feat 1.0, w_tok 0.1, noise 0.2" in hyper_parameters(training)
    assert "w_feat" not in hyper_parameters({"train": train, "ttt": {"steps": 7}})
