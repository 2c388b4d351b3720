"""The embedded target's cache (a GGUF dequantized once into an HF folder), with the slow conversion replaced by a
stand-in that returns a tiny model after a delay: two processes on a cold cache build it once, a corrupt cache is
swapped for a rebuilt one, and a cache this user cannot read is an error that deletes nothing."""

import os
import time
from pathlib import Path

import pytest

from selfspec.target import model as T
from selfspec.core.errors import UserError

def _stand_in(monkeypatch, gguf, log, delay):
    """Replace the GGUF reading in selfspec.target.model._build_gguf_folder by a tiny llama returned after `delay`
    seconds; each build appends a line to `log`."""
    import transformers

    from selfspec.target.tiny import build_tiny_target

    model, tok = build_tiny_target("llama")

    def slow_model(*a, **k):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(delay)
        return model

    monkeypatch.setattr(T, "_package_file", lambda spec: Path(gguf))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", slow_model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tok)
    return log


@pytest.fixture()
def gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF stand-in")
    return path


@pytest.fixture()
def stand_in(gguf, tmp_path, monkeypatch):
    return _stand_in(monkeypatch, gguf, tmp_path / "builds.log", 0.0)


def _race(cache, go, out):
    """One rank of the race (a forked process, so it shares the stand-in): wait for the start, get the cache."""
    import torch

    torch.set_num_threads(1)  # no OpenMP pool in a forked child
    try:
        go.wait(30)
        out.put(("ok", str(T._gguf_cached_folder("pkg/model.gguf", "tiny/llama", cache))))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the test with it
        out.put(("error", f"{type(e).__name__}: {e}"))


def _builds(log):
    return len(log.read_text().split()) if log.exists() else 0


def test_two_processes_on_a_cold_cache_build_it_once(tmp_path, gguf, monkeypatch):
    import multiprocessing as mp

    log = _stand_in(monkeypatch, gguf, tmp_path / "builds.log", 1.0)
    ctx = mp.get_context("fork")
    go, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_race, args=(str(tmp_path / "cache"), go, out)) for _ in range(2)]
    for p in procs:
        p.start()
    go.set()  # both start the cold build at the same moment
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
    assert [r[0] for r in results] == ["ok", "ok"], [r[1] for r in results if r[0] != "ok"][0]
    assert len({r[1] for r in results}) == 1
    assert _builds(log) == 1  # the second process waited for the first and used its folder
    folder = Path(results[0][1])
    assert T._verify_folder(folder)
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no temp folder, no lock file beside it
    assert folder.stat().st_mode & 0o055 == 0o055  # readable by the group and others, as a shared cache must be


def test_corrupt_cache_is_rebuilt_in_place(tmp_path, stand_in):
    folder = T._gguf_cached_folder("pkg/model.gguf", "tiny/llama", str(tmp_path / "cache"))
    assert _builds(stand_in) == 1
    assert T._gguf_cached_folder("pkg/model.gguf", "tiny/llama", str(tmp_path / "cache")) == folder
    assert _builds(stand_in) == 1
    (folder / "model.safetensors").write_bytes(b"damaged")
    assert T._gguf_cached_folder("pkg/model.gguf", "tiny/llama", str(tmp_path / "cache")) == folder
    assert _builds(stand_in) == 2 and T._verify_folder(folder)
    assert [p.name for p in folder.parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name] == []


def test_permission_denied_on_the_cache_is_an_error_and_deletes_nothing(tmp_path, stand_in, monkeypatch):
    folder = T._gguf_cached_folder("pkg/model.gguf", "tiny/llama", str(tmp_path / "cache"))
    files = sorted(p.name for p in folder.iterdir())

    def denied(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(T, "file_sha256", denied)
    with pytest.raises(UserError, match=r"permission.*SELFSPEC_CACHE.*cache_dir") as e:
        T._gguf_cached_folder("pkg/model.gguf", "tiny/llama", str(tmp_path / "cache"))
    assert "\n" not in str(e.value) and str(folder) in str(e.value)
    assert sorted(p.name for p in folder.iterdir()) == files and _builds(stand_in) == 1
