"""Head checkpoints that describe themselves: a folder (config.json + model.safetensors), a single file
(`.safetensors` with the config in its metadata, or a weights-only `.pt`), or a Hub id.

config.json holds the head type and its constructor arguments, the target's identity, a training summary,
metrics and a format version, so `load_head(spec, target)` needs nothing else. Nothing here unpickles
arbitrary objects: safetensors, or `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from heads import HEADS
from heads.errors import UserError
from heads.target import Target, check_identity

FORMAT_VERSION = 1
CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"


def head_record(head, target_identity: dict, **extra: Any) -> dict:
    """The config.json of a head: what it is, what it was trained for, how, and how well."""
    return {"format_version": FORMAT_VERSION, "library": "selfspec", "head": head.head_config(),
            "target": target_identity, **extra}


def _state(head) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu").contiguous() for k, v in head.state_dict().items()}


def save_head(head, folder: str | Path, record: dict) -> Path:
    """Write `folder` atomically (temp dir + rename): a reader sees the old head or the new one, never half."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        save_file(_state(head), str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(json.dumps(record, indent=2, default=str) + "\n")
        _replace_dir(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def save_single_file(head, path: str | Path, record: dict) -> Path:
    """One-file export: `.safetensors` (config in the metadata) or `.pt` (weights-only loadable dict)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    os.close(fd)
    try:
        if path.suffix == ".pt":
            torch.save({"selfspec_config": json.dumps(record, default=str), "state_dict": _state(head)}, tmp)
        else:
            save_file(_state(head), tmp, metadata={"format": "pt", "selfspec_config": json.dumps(record, default=str)})
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_head(spec: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config record, state dict) from a folder, a single file or a Hub id. One-line UserError if bad."""
    path = Path(spec).expanduser()
    if not path.exists():
        if spec.count("/") == 1 and not spec.startswith((".", "/", "~")) and not path.suffix:
            path = _download(spec)
        else:
            raise UserError(f"head checkpoint '{spec}' not found; pass a head folder, a .safetensors/.pt file or a Hub id")
    try:
        if path.is_dir():
            if not (path / CONFIG_NAME).exists() or not (path / WEIGHTS_NAME).exists():
                raise UserError(f"'{spec}' is not a head folder (needs {CONFIG_NAME} and {WEIGHTS_NAME})")
            record = json.loads((path / CONFIG_NAME).read_text())
            state = load_file(str(path / WEIGHTS_NAME))
        elif path.suffix == ".pt":
            try:
                blob = torch.load(path, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as e:  # weights_only refuses code and objects other than tensors
                raise UserError(f"'{spec}' holds pickled objects other than tensors (code, classes): refused, nothing "
                                "in it was run; use a .safetensors head or a head folder") from e
            if not isinstance(blob, dict) or "selfspec_config" not in blob or "state_dict" not in blob:
                raise UserError(f"'{spec}' is not a selfspec head checkpoint (no selfspec_config/state_dict in it)")
            record, state = json.loads(blob["selfspec_config"]), blob["state_dict"]
        else:
            from safetensors import safe_open

            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
            if "selfspec_config" not in meta:
                raise UserError(f"'{spec}' is a safetensors file without a selfspec head config")
            record, state = json.loads(meta["selfspec_config"]), load_file(str(path))
    except UserError:
        raise
    except (SafetensorError, OSError, ValueError, KeyError, RuntimeError, EOFError) as e:
        raise UserError(f"head checkpoint '{spec}' is corrupt or truncated ({type(e).__name__}); re-export or retrain it") from e
    if record.get("library") != "selfspec" or "head" not in record or "target" not in record:
        raise UserError(f"'{spec}' is not a selfspec head checkpoint (no head/target record in its config)")
    if record.get("format_version", 0) > FORMAT_VERSION:
        raise UserError(f"'{spec}' has format version {record['format_version']}; this selfspec reads up to {FORMAT_VERSION}: upgrade")
    return record, state


def load_head(spec: str, target: Target, expected_type: Optional[str] = None):
    """Build the head a checkpoint describes, check it belongs to `target`, load weights, bind the target."""
    record, state = read_head(spec)
    check_identity(record["target"], target.identity)
    head_cfg = dict(record["head"])
    head_type = head_cfg.pop("type")
    if head_type not in HEADS:
        raise UserError(f"'{spec}' holds an unknown head type '{head_type}'; known: {', '.join(HEADS)}")
    if expected_type and head_type != expected_type:
        raise UserError(f"'{spec}' is a '{head_type}' head, not '{expected_type}'; pass drafter={head_type}")
    head = HEADS[head_type](target.model, **head_cfg, **_buffers_for_init(state))
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise UserError(f"'{spec}' does not match a '{head_type}' head of that config "
                        f"(missing {missing[:2]}, unexpected {unexpected[:2]}); re-export it")
    head.record = record
    return head.to(target.model.device).eval()


def _buffers_for_init(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Constructor inputs that live in the state dict (the draft vocabulary: EAGLE's `draft_vocab`, EAGLE-3's
    `d2t`/`t2d`), so it is never rebuilt."""
    return {k: state[k] for k in ("draft_vocab", "d2t", "t2d") if k in state}


def _download(repo_id: str) -> Path:
    """A published head (config.json, model.safetensors, README.md) through the Hub cache. Honours HF_HUB_OFFLINE,
    HF_HUB_CACHE, HF_ENDPOINT and the token like any huggingface_hub download; every failure is one line."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, HFValidationError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    try:
        return Path(snapshot_download(repo_id, allow_patterns=[CONFIG_NAME, WEIGHTS_NAME, "README.md"]))
    except HFValidationError as e:
        raise UserError(f"'{repo_id}' is neither a file nor a valid Hub id ('<user>/<name>'); pass a head folder, "
                        "a .safetensors/.pt file or a Hub id") from e
    except GatedRepoError as e:
        raise UserError(f"Hub repo '{repo_id}' is gated: accept its terms on the Hub, then `hf auth login`") from e
    except RepositoryNotFoundError as e:
        raise UserError(f"Hub repo '{repo_id}' not found (or private: log in with `hf auth login` or set HF_TOKEN)") from e
    except RevisionNotFoundError as e:
        raise UserError(f"Hub repo '{repo_id}' has no main branch yet (nothing published?)") from e
    except LocalEntryNotFoundError as e:  # nothing usable in the cache, and the Hub did not answer with the files
        cause = e.__cause__
        status = getattr(getattr(cause, "response", None), "status_code", None)
        if constants.HF_HUB_OFFLINE:
            why = "HF_HUB_OFFLINE is set (unset it, or download the head once online)"
        elif status is not None:
            why = f"the Hub answered {status} ({'log in with `hf auth login` or set HF_TOKEN' if status in (401, 403) else 'try again later'})"
        else:
            why = f"the Hub cannot be reached ({type(cause or e).__name__}: check the network or HF_ENDPOINT)"
        raise UserError(f"'{repo_id}' is not cached and {why}") from e
    except HfHubHTTPError as e:
        raise UserError(f"cannot download '{repo_id}' from the Hub: {' '.join(str(e).split())[:200]}") from e
    except Exception as e:  # the HTTP client's own connection errors (httpx's are not OSError subclasses)
        transport = {"TransportError", "TimeoutException", "NetworkError", "ConnectError", "ConnectionError"}
        if not isinstance(e, OSError) and not transport & {c.__name__ for c in type(e).__mro__}:
            raise
        raise UserError(f"cannot download '{repo_id}' from the Hub ({type(e).__name__}: check the network or "
                        "HF_ENDPOINT; rerunning resumes the download)") from e


def _replace_dir(src: Path, dst: Path) -> None:
    """Swap `src` into `dst`: rename the old one away first, so a crash leaves one complete folder behind."""
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        os.replace(dst, old)
        os.replace(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)
