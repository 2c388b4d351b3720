"""Loading a head refuses, in one line, what would fail later or silently: non-finite weights, vocabulary maps out
of range, a typo'd local path read as a Hub id; Hub heads can be pinned to a revision; a checkpoint that cannot be
read for a reason other than damage (permissions, memory) is not called corrupt."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from selfspec.heads.checkpoint import DIGEST_KEY, head_record, load_head, read_head, save_head, weights_digest
from selfspec.methods.eagle.head import build_eagle
from selfspec.methods.eagle3.head import build_eagle3
from selfspec.core.errors import UserError
from selfspec.methods.layerskip.head import build_layerskip
from selfspec.target.model import load_target


@pytest.fixture(scope="module")
def target():
    return load_target("tiny:llama", tiny={"num_hidden_layers": 4})


def _saved(tmp_path, target, kind):
    torch.manual_seed(0)
    if kind == "eagle":
        head = build_eagle(target.model, vocab_size=32, draft_vocab=torch.arange(32) + 7)
    elif kind == "eagle3":
        head = build_eagle3(target.model, aux_layers=[1, 2, 3], draft_vocab=torch.arange(40, 80))
    else:
        head = build_layerskip(target.model, exit_layer=2, adapter="light", rank=8, vocab_size=40,
                               draft_vocab=torch.arange(40) + 10)
    return save_head(head, tmp_path / kind, head_record(head, target.identity))


def _tamper(folder, **tensors):
    """Rewrite some tensors of a saved head folder (None deletes one), with the digest of what is now there: the head
    a writer of these values would have saved (a digest of other weights is refused first: test_weights_digest.py)."""
    state = load_file(str(folder / "model.safetensors"))
    for k, v in tensors.items():
        state.pop(k) if v is None else state.__setitem__(k, v)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    record = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**record, DIGEST_KEY: weights_digest(state)}))


def _refused(spec, target, match):
    with pytest.raises(UserError, match=match) as e:
        load_head(str(spec), target)
    assert "\n" not in str(e.value)
    return str(e.value)


# ---------------------------------------------------------------------------------------------- #6 non-finite


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_head_is_refused_at_load_naming_the_tensor(tmp_path, target, bad):
    folder = _saved(tmp_path, target, "eagle")
    w = load_file(str(folder / "model.safetensors"))["fc.weight"]
    w[3, 5] = bad
    _tamper(folder, **{"fc.weight": w})
    _refused(folder, target, r"non-finite.*'fc\.weight'")


# ---------------------------------------------------------------------------------------------- #7 vocab maps


@pytest.mark.parametrize("kind", ["eagle", "layerskip"])
@pytest.mark.parametrize("damage, match", [
    ("too_big", r"draft_vocab.*\[0, 320\)"),
    ("negative", r"draft_vocab.*\[0, 320\)"),
    ("float", r"draft_vocab.*integer"),
    ("two_d", r"draft_vocab.*1-D"),
    ("wrong_count", r"draft_vocab.*vocab_size"),
])
def test_draft_vocab_out_of_range_or_shape_is_refused(tmp_path, target, kind, damage, match):
    folder = _saved(tmp_path, target, kind)
    dv = load_file(str(folder / "model.safetensors"))["draft_vocab"]
    n = dv.numel()
    bad = {"too_big": dv + 300, "negative": dv - 100, "float": dv.float() + 0.5, "two_d": dv.view(2, n // 2),
           "wrong_count": dv[:-1]}[damage]
    _tamper(folder, draft_vocab=bad)
    _refused(folder, target, match)


@pytest.mark.parametrize("damage, match", [
    ("d2t_out_of_range", r"d2t.*\[0, 320\)"),
    ("t2d_wrong_length", r"t2d.*320"),
    ("t2d_disagrees", r"t2d.*d2t"),
    ("lm_head_rows", r"d2t.*40.*lm_head.weight.*39"),
    ("d2t_float", r"d2t.*integer"),
])
def test_eagle3_vocab_maps_are_checked(tmp_path, target, damage, match):
    folder = _saved(tmp_path, target, "eagle3")
    state = load_file(str(folder / "model.safetensors"))
    d2t, t2d = state["d2t"], state["t2d"]
    if damage == "d2t_out_of_range":
        d2t = d2t.clone()
        d2t[-1] = 1000
        _tamper(folder, d2t=d2t)
    elif damage == "t2d_wrong_length":
        _tamper(folder, t2d=t2d[:-6])
    elif damage == "t2d_disagrees":
        t2d = t2d.clone()
        t2d[0] = True
        _tamper(folder, t2d=t2d)
    elif damage == "lm_head_rows":
        _tamper(folder, **{"lm_head.weight": state["lm_head.weight"][:-1]})
    else:
        _tamper(folder, d2t=d2t.double())
    _refused(folder, target, match)


def test_a_tensor_of_the_wrong_shape_is_one_line(tmp_path, target):
    folder = _saved(tmp_path, target, "eagle")
    _tamper(folder, **{"fc.weight": torch.zeros(64, 100)})
    _refused(folder, target, r"fc\.weight.*\[64, 100\].*\[64, 128\]")


# ---------------------------------------------------------------------------------------------- #10 paths, revision


@pytest.fixture()
def no_network(monkeypatch):
    import huggingface_hub

    def boom(*a, **k):
        raise AssertionError("went to the network")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", boom)


def test_typo_of_a_local_folder_is_not_sent_to_the_hub(tmp_path, target, monkeypatch, no_network):
    _saved(tmp_path / "outputs", target, "eagle")
    (tmp_path / "outputs" / "eagle").rename(tmp_path / "outputs" / "head")
    monkeypatch.chdir(tmp_path)
    msg = _refused("outputs/haed", target, r"no such (folder|file) 'outputs/haed'.*did you mean 'outputs/head'")
    assert "Hub" not in msg.split(";")[0]


def test_missing_local_folder_without_a_close_name(tmp_path, target, monkeypatch, no_network):
    (tmp_path / "runs").mkdir()
    monkeypatch.chdir(tmp_path)
    _refused("runs/xyz", target, r"no such (folder|file) 'runs/xyz'")


def _hub_snapshot(tmp_path, target, commit="c" * 40):
    folder = _saved(tmp_path, target, "eagle")
    snap = tmp_path / "hub" / "snapshots" / commit
    snap.parent.mkdir(parents=True)
    folder.rename(snap)
    return snap


def test_hub_head_is_pinned_by_revision_and_it_is_recorded(tmp_path, target, monkeypatch):
    import huggingface_hub

    snap = _hub_snapshot(tmp_path, target)
    calls = []

    def fake(repo_id, **kw):
        calls.append((repo_id, kw.get("revision")))
        return str(snap)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    monkeypatch.chdir(tmp_path)
    record, _ = read_head("someone/head", revision="v1.0")
    assert calls == [("someone/head", "v1.0")]
    assert record["source"] == {"hub": "someone/head", "revision": "v1.0", "commit": "c" * 40}
    head = load_head("someone/head", target, revision="v1.0")
    assert calls[-1] == ("someone/head", "v1.0") and head.record["source"]["revision"] == "v1.0"
    load_head("someone/head", target)
    assert calls[-1] == ("someone/head", None)


def test_revision_of_a_local_head_is_refused(tmp_path, target):
    folder = _saved(tmp_path, target, "eagle")
    with pytest.raises(UserError, match="revision.*Hub") as e:
        read_head(str(folder), revision="v1")
    assert "\n" not in str(e.value)


def test_unknown_revision_names_it(tmp_path, target, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import RevisionNotFoundError

    class Response:  # what HfHubHTTPError reads of the HTTP response
        headers, request, status_code = {}, None, 404

    def fake(repo_id, **kw):
        raise RevisionNotFoundError("no such revision", response=Response())

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="no revision 'v9'") as e:
        read_head("someone/head", revision="v9")
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------- #11 not corrupt


def test_permission_denied_is_not_called_corrupt(tmp_path, target, monkeypatch):
    folder = _saved(tmp_path, target, "eagle")

    def denied(path, *a, **k):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr("selfspec.heads.checkpoint.load_file", denied)
    msg = _refused(folder, target, "permission")
    assert "corrupt" not in msg and "model.safetensors" in msg


@pytest.mark.parametrize("error", [MemoryError, KeyboardInterrupt])
def test_memory_error_and_interrupts_pass_through(tmp_path, target, monkeypatch, error):
    folder = _saved(tmp_path, target, "eagle")

    def fail(*a, **k):
        raise error()

    monkeypatch.setattr("selfspec.heads.checkpoint.load_file", fail)
    with pytest.raises(error):
        load_head(str(folder), target)


def test_config_that_is_not_an_object_is_one_line(tmp_path, target):
    folder = _saved(tmp_path, target, "eagle")
    (folder / "config.json").write_text(json.dumps([1, 2]))
    _refused(folder, target, "not a selfspec head")
