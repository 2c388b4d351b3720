"""Publishing heads on the Hugging Face Hub: the staged folder (config.json, model.safetensors, README.md model
card), the upload, and one-line messages for the ways an upload fails.

A published repo is exactly a head folder plus its card, so `load_head("<user>/<name>", target)` reads it back
like any folder. Nothing here imports decode/ or train/; the card (publish/card.py) is rendered from the head's
own config.json and weights, when one sits beside the head the last benchmark's bench.json, and when given
scripts/serve_bench.py's JSON (the head served by vLLM and llama.cpp).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Optional

from selfspec.core.errors import UserError
from selfspec.core.ownership import Kind, check_output, owned_dir
from selfspec.heads.checkpoint import CONFIG_NAME, WEIGHTS_NAME, read_head
from selfspec.publish.card import model_card

CARD_NAME = "README.md"
UPLOADED = (CONFIG_NAME, WEIGHTS_NAME, CARD_NAME)  # exactly what a published repo holds
BENCH_NAME = "bench.json"


# ---------------------------------------------------------------------------------------------- names


def check_repo_id(repo_id: str) -> str:
    """'<user or org>/<name>' with the Hub's characters, or a UserError saying so."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not repo_id or repo_id.startswith("<") or repo_id.count("/") != 1:
        raise UserError(f"repo_id must be '<user or org>/<name>' (got '{repo_id}')")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise UserError(f"repo_id '{repo_id}' is not a valid Hub id: {' '.join(str(e).split())[:160]}") from e
    return repo_id


# ---------------------------------------------------------------------------------------------- staging


def find_bench(head_dir: Path) -> Optional[Path]:
    """bench.json beside the head folder (`<run>/head` -> `<run>/bench.json`), or inside it."""
    for p in (head_dir.parent / BENCH_NAME, head_dir / BENCH_NAME):
        if p.is_file():
            return p
    return None


def stage(head: str, folder: str | Path, repo_id: str, bench: Optional[str] = None,
          serving: Optional[str] = None) -> Path:
    """Write exactly the folder that would be uploaded: config.json, model.safetensors (copied byte for byte
    from a head folder, or written from a single-file checkpoint) and the rendered README.md. Everything is read
    and checked first; the folder is built beside `folder` and swapped in whole (selfspec.core.atomic), so a failure
    leaves a previous staging as it was."""
    record, state = read_head(head)  # validates it is a readable selfspec head before anything is written
    src = Path(head).expanduser()
    folder = Path(folder)
    inputs = [("head", head), ("bench", bench), ("serving", serving)]
    check_output(folder, "out", STAGED_KIND, inputs=inputs)
    bench_path = Path(bench) if bench else (find_bench(src) if src.is_dir() else None)
    bench_data = _read_bench(bench_path) if bench_path else None
    card = model_card(record, repo_id, state, bench_data, _read_serving(Path(serving)) if serving else None)
    with owned_dir(folder, "out", STAGED_KIND, inputs=inputs) as tmp:
        if src.is_dir():
            for name in (CONFIG_NAME, WEIGHTS_NAME):
                shutil.copyfile(src / name, tmp / name)
        else:
            from selfspec.core.atomic import save_tensors

            (tmp / CONFIG_NAME).write_text(json.dumps(record, indent=2, default=str) + "\n")
            save_tensors({k: v.contiguous() for k, v in state.items()}, tmp / WEIGHTS_NAME, metadata={"format": "pt"})
        (tmp / CARD_NAME).write_text(card)  # fsynced with the folder before the swap
    return folder


def _staged_files(folder: Path) -> Optional[list[str]]:
    """A folder stage() wrote: a head's record and only what is uploaded (core/ownership.py; no owner file, since
    the folder is exactly what would be uploaded)."""
    names = {p.name for p in folder.iterdir()}
    if names <= set(UPLOADED) and json.loads((folder / CONFIG_NAME).read_text()).get("library") == "selfspec":
        return list(UPLOADED)
    return None


STAGED_KIND = Kind("staged repo", folder=True, mine=_staged_files, marked=False)


def _read_bench(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"bench file '{path}' is unreadable ({type(e).__name__}); fix or remove it") from e
    if not isinstance(data, dict) or not isinstance(data.get("methods", {}), dict):
        raise UserError(f"bench file '{path}' has no 'methods' mapping; fix or remove it")
    for name, row in data.get("methods", {}).items():
        if not isinstance(row, dict):
            raise UserError(f"bench file '{path}': methods.{name} must be a mapping of results (tau, tokens_per_s, "
                            f"speedup...), got {type(row).__name__}; pass scripts/bench.py's output_file")
    return data


def _read_serving(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"serving file '{path}' is unreadable ({type(e).__name__}); pass scripts/serve_bench.py's "
                        "output_file") from e
    if (not isinstance(data, dict) or not isinstance(data.get("table"), str)
            or not isinstance(data.get("engines"), dict)):
        raise UserError(f"serving file '{path}' is not scripts/serve_bench.py's output (no 'table' and 'engines')")
    return data


# ---------------------------------------------------------------------------------------------- upload


def hub_token() -> str:
    """HF_TOKEN, or the token cached by `hf auth login`; a one-line UserError when neither exists."""
    from huggingface_hub import get_token

    token = get_token()
    if not token:
        raise UserError("no Hugging Face token: run `hf auth login` or set HF_TOKEN (a token with write access)")
    return token


def upload(folder: str | Path, repo_id: str, private: bool = False, revision: Optional[str] = None,
           commit_message: Optional[str] = None) -> str:
    """create_repo(exist_ok) + upload_folder of the staged files; returns the commit URL.

    Safe to rerun after an interruption: upload_folder is idempotent (files the Hub already holds with the
    same content are not sent again, and an unchanged folder makes no new commit)."""
    from huggingface_hub import HfApi

    token = hub_token()
    api = HfApi(token=token)
    message = commit_message or f"Upload selfspec head ({', '.join(UPLOADED)})"
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision and revision != "main":
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        info = api.upload_folder(repo_id=repo_id, folder_path=str(folder), allow_patterns=list(UPLOADED),
                                 revision=revision, commit_message=message)
    except Exception as e:  # mapped to one line below; anything unrecognised is re-raised as is
        raise hub_error(e, repo_id, "upload to") from e
    return str(getattr(info, "commit_url", info))


def hub_error(e: BaseException, repo_id: str, action: str = "reach") -> BaseException:
    """A Hub/network failure as a one-line UserError saying what to do; other exceptions come back unchanged."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    if isinstance(e, UserError):
        return e
    if isinstance(e, OfflineModeIsEnabled):
        return UserError(f"cannot {action} '{repo_id}': HF_HUB_OFFLINE is set; unset it, or stage the folder with "
                         "dry_run=true out=<folder>")
    status = getattr(getattr(e, "response", None), "status_code", None)
    if isinstance(e, HfHubHTTPError) and status is not None:
        detail = _server_message(e)
        if status == 401:
            return UserError(f"the Hub rejected the token (401) for '{repo_id}': run `hf auth login` again or set "
                             f"HF_TOKEN to a valid token{detail}")
        if status == 403:
            return UserError(f"no write access to '{repo_id}' (403): the repo or namespace belongs to someone else, or "
                             f"the token is read-only; use your own user/org or a write token{detail}")
        if status == 404:
            return UserError(f"'{repo_id}' not found (404) or not visible with this token{detail}")
        return UserError(f"the Hub answered {status} for '{repo_id}'{detail}; rerunning is safe (the upload is "
                         "idempotent)")
    if is_network_error(e):
        from huggingface_hub import constants

        return UserError(f"cannot {action} the Hub at {constants.ENDPOINT} ({type(e).__name__}); check the network "
                         "or HF_ENDPOINT, then rerun: the upload is idempotent")
    return e


def _server_message(e: BaseException) -> str:
    msg = getattr(e, "server_message", None) or ""
    msg = " ".join(str(msg).split())[:160]
    return f" (Hub: {msg})" if msg else ""


def is_network_error(e: BaseException) -> bool:
    """Connection/timeout errors of whichever HTTP client huggingface_hub uses (httpx, its fork, requests)."""
    names = {c.__name__ for c in type(e).__mro__}
    return bool(names & {"ConnectError", "ConnectTimeout", "TimeoutException", "NetworkError", "TransportError",
                         "ConnectionError", "RemoteProtocolError", "ReadTimeout", "ProxyError"})
