"""Head checkpoints that describe themselves: a folder (config.json + model.safetensors), a single file
(`.safetensors` with the config in its metadata, or a weights-only `.pt`), or a Hub id.

config.json holds the head type and its constructor arguments, the target's identity, a training summary,
metrics and a format version, so `load_head(spec, target)` needs nothing else. Nothing here unpickles arbitrary
objects: safetensors, or `torch.load(weights_only=True)`. Loading refuses, in one line, what would fail later or
silently: non-finite weights, vocabulary maps outside the target's vocabulary, tensors of the wrong shape. Writes
go through heads/atomic.py: a reader finds the old head or the new one, never half of one or none.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import load_file

from selfspec.core.atomic import atomic_dir, atomic_path, recover_dir, save_tensors, save_torch
from selfspec.core.errors import UserError, reading
from selfspec.target.kernels import use as use_kernels
from selfspec.core.ownership import Kind
from selfspec.target.model import Target, check_identity, check_recorded_identity, is_transport_error
from selfspec.heads.layers import recorded_layer
from selfspec.heads.vocab import check_vocab_maps
from selfspec.registry import method, names

# 2: the record holds weights_sha256 (DIGEST_KEY), so one without it is refused; 1 (the shipped heads): it may not
FORMAT_VERSION = 2
DIGESTED_FROM = 2  # the first format version whose records always hold the digest
CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"


def head_record(head, target_identity: dict, **extra: Any) -> dict:
    """The config.json of a head: what it is, what it was trained for, how, and how well."""
    return {"format_version": FORMAT_VERSION, "library": "selfspec", "head": head.head_config(),
            "target": target_identity, **extra}


def trained_seconds(training: dict) -> Optional[float]:
    """Seconds of training a record's `training` states, every launch of a resumed run included: a checkpoint's
    `train_seconds` is the run's total, a finished head's is its last launch's, beside `total_train_seconds`."""
    seconds = training.get("total_train_seconds", training.get("train_seconds"))
    return float(seconds) if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) else None


def lineage_seconds(training: dict) -> Optional[float]:
    """Seconds of training behind a head's weights: its own (trained_seconds) and, for a head fine-tuned from
    another (`init_from`, a chunk of a chunked training), that head's lineage as its recipe recorded it
    (`init_train_seconds`). None when either is unknown, as for a fine-tuned head saved before the field."""
    own = trained_seconds(training)
    if "init_train_seconds" in training:
        before = training["init_train_seconds"]
        return None if own is None or before is None else round(own + float(before), 3)
    continued = training.get("init_from") or any(isinstance(v, dict) and v.get("init_from") for v in training.values())
    return None if continued else own


def _state(head) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu").contiguous() for k, v in head.state_dict().items()}


DIGEST_KEY = "weights_sha256"  # in a record: weights_digest of the weights saved with it (heads saved before: none)


def weights_digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in name order: the same for a folder, a .safetensors
    and a .pt of one head, and changed by any flipped bit a file format's own checks would let through."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def signed(record: dict, state: dict[str, torch.Tensor]) -> dict:
    """`record` with the digest of the weights written beside it (a digest it carried from another head replaced)."""
    return {**record, DIGEST_KEY: weights_digest(state)}


def check_digest(record: dict, state: dict[str, torch.Tensor], spec: str, weights: str = WEIGHTS_NAME,
                 fix: str = "copy or download it again, or retrain it") -> None:
    """The weights are the ones saved with the record: a flipped bit loads fine and drafts wrong, silently. A record
    of format DIGESTED_FROM or later without its digest is refused too (deleting it must not let a damaged head
    through); one saved before heads recorded one (format 1: the shipped heads) has nothing to compare."""
    recorded, version = record.get(DIGEST_KEY), record.get("format_version", 0)
    if recorded is None and version >= DIGESTED_FROM:
        raise UserError(f"head checkpoint '{spec}': its record has no {DIGEST_KEY}, which every head of format "
                        f"{DIGESTED_FROM} or later holds, so its weights cannot be checked: restore its record, or "
                        f"{fix}")
    if recorded is not None and recorded != weights_digest(state):
        raise UserError(f"head checkpoint '{spec}': its weights ({weights} or the file itself) do not match the "
                        f"sha256 its record holds ({DIGEST_KEY}): changed or damaged since it was saved; {fix}")


def save_head(head, folder: str | Path, record: dict) -> Path:
    """Write `folder` atomically (selfspec.core.atomic.atomic_dir): a reader sees the old head or the new one, never
    half, never none; leftovers of killed saves beside it are removed. Only its two files are replaced: what else the
    old folder holds (a user's NOTES.md, plots/) is carried into the new one (a run extended or replaced keeps them)."""
    with atomic_dir(folder, keep=True) as tmp:
        write_head_files(head, tmp, record)
    return Path(folder)


def write_head_files(head, folder: Path, record: dict) -> None:
    """A head folder's two files, into `folder` (a temp folder the caller swaps in)."""
    state = _state(head)
    save_tensors(state, folder / WEIGHTS_NAME, metadata={"format": "pt"})
    (folder / CONFIG_NAME).write_text(json.dumps(signed(record, state), indent=2, default=str) + "\n")


def _head_files(folder: Path) -> Optional[list[str]]:
    """A head folder selfspec wrote before head folders carried an owner file: its config.json record proves it."""
    if json.loads((folder / CONFIG_NAME).read_text()).get("library") == "selfspec":
        return [CONFIG_NAME, WEIGHTS_NAME]
    return None


HEAD_KIND = Kind("selfspec head", folder=True, mine=_head_files, needs_overwrite=True)  # core/ownership.py


def save_single_file(head, path: str | Path, record: dict) -> Path:
    """One-file export: `.safetensors` (config in the metadata) or `.pt` (weights-only loadable dict), written
    atomically (selfspec.core.atomic.atomic_path)."""
    path, state = Path(path), _state(head)
    config = json.dumps(signed(record, state), default=str)
    with atomic_path(path) as tmp:
        if path.suffix == ".pt":
            save_torch({"selfspec_config": config, "state_dict": state}, tmp)
        else:
            save_tensors(state, tmp, metadata={"format": "pt", "selfspec_config": config})
    return path


def read_head(spec: str, revision: Optional[str] = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config record, state dict) from a folder, a single file or a Hub id. One-line UserError if bad.

    `revision` (branch, tag or commit; None = main) pins a Hub head; a Hub head's record gets
    `source = {"hub": id, "revision": revision, "commit": the snapshot read}`. A missing path under an existing
    local folder (`outputs/haed`) is reported as missing, never sent to the Hub."""
    path, source = _locate(str(spec), revision)
    record, state = _read(path, str(spec))
    _check_record(record, str(spec))
    check_digest(record, state, str(spec), _weights_file(path).name)
    for name, t in state.items():  # a diverged run's NaN would otherwise surface as a sampling error much later
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise UserError(f"head checkpoint '{spec}' has non-finite values (NaN/Inf) in tensor '{name}': its "
                            "training diverged; retrain it or use an earlier checkpoint")
    if source:
        record["source"] = source
    return record, state


def read_record(spec: str, revision: Optional[str] = None) -> dict:
    """read_head's record alone, checked the same way, without loading the weights: a folder's config.json, a
    `.safetensors` file's metadata (its header is still checked), a `.pt` file's selfspec_config (a pickle-free
    torch.load reads it whole). For what only the record answers: the head's type, its training summary."""
    path, source = _locate(str(spec), revision)
    record, _ = _read(path, str(spec), weights=False)
    _check_record(record, str(spec))
    if source:
        record["source"] = source
    return record


def _locate(spec: str, revision: Optional[str]) -> tuple[Path, Optional[dict]]:
    """The local path of a head (a Hub id is downloaded through the cache) and, for a Hub head, its source."""
    path = Path(spec).expanduser()
    try:
        recover_dir(path)  # a head folder a crash left renamed away (selfspec.core.atomic) is put back
    except OSError:
        pass  # not ours to fix (read-only place): then it is reported missing below
    if path.exists():
        if revision is not None:
            raise UserError(f"revision='{revision}' pins a Hub head, but '{spec}' is a local path; drop the revision")
        return path, None
    if _hub_id_shaped(spec):
        path = _download(spec, revision)
        return path, {"hub": spec, "revision": revision, "commit": path.name}  # snapshot folders are named by commit
    raise UserError(_not_found(spec))


def _check_record(record: Any, spec: str) -> None:
    """A selfspec head record (head type, target) of a format version this selfspec reads."""
    if (not isinstance(record, dict) or record.get("library") != "selfspec" or not isinstance(record.get("head"), dict)
            or "type" not in record["head"] or "target" not in record):
        raise UserError(f"'{spec}' is not a selfspec head checkpoint (no head/target record in its config)")
    if not isinstance(record["head"]["type"], str):  # it picks the drafter and the builder: a name, never a list
        raise UserError(f"'{spec}': head type must be a string ({', '.join(names())}), got {record['head']['type']!r}; "
                        "re-export the head")
    version = record.get("format_version", 0)
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise UserError(f"'{spec}': format_version must be an integer >= 0 (this selfspec reads up to "
                        f"{FORMAT_VERSION}), got {version!r}; re-export the head")
    if version > FORMAT_VERSION:
        raise UserError(f"'{spec}' has format version {record['format_version']}; this selfspec reads up to "
                        f"{FORMAT_VERSION}: upgrade")
    check_recorded_identity(record["target"], f"head '{spec}'")
    _check_head_values(record, spec)


def _check_head_values(record: dict, spec: str) -> None:
    """The head config's sizes and ids that readers of the record alone (export, publish) use: integers within the
    target's vocabulary, its type's own within their ranges (Method.ranges: a DFlash block, a P-EAGLE depth), and the
    ones its type must record present."""
    head, vocab = record["head"], record["target"]["vocab_size"]
    own = method(head["type"]) if head["type"] in names() else None
    for key in own.recorded if own else ():  # Method.recorded: the keys it must state
        if head.get(key) is None:
            raise UserError(f"'{spec}': its {head['type']} head config has no {key} (null): the head was trained with "
                            f"one, and a default picked here could differ; restore its record or retrain it")
    ranges = (("vocab_size", 1, vocab), ("mask_token_id", 0, vocab - 1), *(own.ranges if own else ()))
    for key, low, high in ranges:
        value = head.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            kind = "a string" if isinstance(value, str) else f"a {type(value).__name__}"
            raise UserError(f"'{spec}': head config '{key}' is {kind} ({value!r}); it must be an integer in "
                            f"[{low}, {high}]; restore its record or retrain it")
        if not low <= value <= high:
            raise UserError(f"'{spec}': head config '{key}'={value} is outside [{low}, {high}] (its target's "
                            f"vocabulary has {vocab} tokens); restore its record or retrain it")


def _is_checkpoint(path: Path) -> bool:
    """A training checkpoint folder (train/state.py), whose head.safetensors holds the head and its record."""
    return path.is_dir() and (path / "position.json").exists() and not (path / CONFIG_NAME).exists()


def _weights_file(path: Path) -> Path:
    """The file holding a head's weights: the file itself, a head folder's model.safetensors, or a training
    checkpoint's head.safetensors."""
    if not path.is_dir():
        return path
    return path / ("head.safetensors" if _is_checkpoint(path) else WEIGHTS_NAME)


def _regular(path: Path, spec: str) -> None:
    """Only regular files are read: a FIFO would block the read forever and a device never ends (both `exist`)."""
    if path.exists() and not path.is_file():
        raise UserError(f"head checkpoint '{spec}': '{path.name}' is not a regular file (a pipe, device or socket), "
                        "which could block the read forever; pass a head whose files are regular files")


def _read(path: Path, spec: str, weights: bool = True) -> tuple[Any, dict[str, torch.Tensor]]:
    """Parse a head folder or file (`weights=False`: the record only, the state {}); what fails to read is one
    line (selfspec.core.errors.reading)."""
    from safetensors import safe_open

    with reading("head checkpoint", spec, fix="; re-export or retrain it",
                 pickled_fix="; use a .safetensors head or a head folder"):
        if _is_checkpoint(path):
            path = path / "head.safetensors"  # a training checkpoint (train/state.py): its head file holds the record
        if path.is_dir():
            if not (path / CONFIG_NAME).exists() or not (path / WEIGHTS_NAME).exists():
                inner = path / "head"
                hint = (f"; a training run's head is its head/ folder: pass head={Path(spec) / 'head'}"
                        if (inner / CONFIG_NAME).exists() else "")
                raise UserError(f"'{spec}' is not a head folder (needs {CONFIG_NAME} and {WEIGHTS_NAME}){hint}")
            _regular(path / CONFIG_NAME, spec)
            _regular(path / WEIGHTS_NAME, spec)
            record = json.loads((path / CONFIG_NAME).read_text())
            if not weights:
                with safe_open(str(path / WEIGHTS_NAME), "pt"):  # its header: a truncated file fails here too
                    return record, {}
            return record, load_file(str(path / WEIGHTS_NAME))
        _regular(path, spec)
        if path.suffix == ".pt":
            blob = torch.load(path, map_location="cpu", weights_only=True)
            if (not isinstance(blob, dict) or "selfspec_config" not in blob
                    or not isinstance(blob.get("state_dict"), dict)
                    or not all(isinstance(t, torch.Tensor) for t in blob["state_dict"].values())):
                raise UserError(f"'{spec}' is not a selfspec head checkpoint (no selfspec_config/state_dict in it)")
            return json.loads(blob["selfspec_config"]), blob["state_dict"] if weights else {}
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        if "selfspec_config" not in meta:
            old = " (a training checkpoint written before checkpoints kept it: use the run's head/)" if (
                path.name == "head.safetensors" and (path.parent / "position.json").exists()) else ""
            raise UserError(f"'{spec}' is a safetensors file without a selfspec head config{old}")
        return json.loads(meta["selfspec_config"]), load_file(str(path)) if weights else {}


# What a head file's name ends with: such a path is never taken for a Hub id.
HEAD_FILE_SUFFIXES = (".pt", ".pth", ".safetensors", ".bin", ".json")


def _hub_id_shaped(spec: str) -> bool:
    """'<user>/<name>', and not a path: `outputs/haed` under an existing local `outputs/` is a typo, not a Hub id."""
    if spec.count("/") != 1 or spec.startswith((".", "/", "~")) or Path(spec).suffix in HEAD_FILE_SUFFIXES:
        return False
    return not Path(spec.split("/")[0]).is_dir()


def _not_found(spec: str) -> str:
    path = Path(spec).expanduser()
    what = "file" if path.suffix in HEAD_FILE_SUFFIXES else "folder"
    hint = ""
    try:
        if path.parent.is_dir():
            names = [p.name for p in path.parent.iterdir() if not p.name.startswith(".")]
            close = difflib.get_close_matches(path.name, names, n=1)
            if close:
                hint = f" (did you mean '{Path(spec).parent / close[0]}'?)"
    except OSError:
        pass
    first = spec.split("/")[0]
    local = (f"; '{first}' is a local folder, so this is not read as a Hub id"
             if spec.count("/") == 1 and not spec.startswith((".", "/", "~")) and Path(first).is_dir() else "")
    return (f"head checkpoint not found: no such {what} '{spec}'{hint}{local}; pass a head folder, "
            "a .safetensors/.pt file or a Hub id")


def head_type(spec: str, revision: Optional[str] = None) -> str:
    """The type a head checkpoint records (a registered one, registry.py): also the drafter that decodes with it.
    Its record alone is read (read_record), not its weights."""
    return read_record(spec, revision)["head"]["type"]


def load_head(spec: str, target: Target, expected_type: Optional[str] = None, revision: Optional[str] = None):
    """Build the head a checkpoint describes, check it belongs to `target`, load weights, bind the target.
    `revision` pins a Hub head (see read_head)."""
    record, state = read_head(spec, revision)
    check_identity(record["target"], target.identity)
    head_type = record["head"]["type"]
    if expected_type and head_type in names() and head_type != expected_type:
        raise UserError(f"'{spec}' is a '{head_type}' head, not '{expected_type}'; pass drafter={head_type}")
    head = build_head(record["head"], state, target, f"'{spec}'")
    head.record = record
    return head


def build_head(head_cfg: dict, state: dict[str, torch.Tensor], target: Target, what: str):
    """The head `head_cfg` (a record's "head": its type and constructor arguments) describes, built for `target`
    with `state` loaded, bound, in eval mode: load_head's last step, and publish/importer.py's for heads trained
    elsewhere. Refuses in one line what does not fit: an unknown type, vocabulary maps outside the target's
    vocabulary, a config the builder rejects, tensors of the wrong shape, missing, or with no place in the head.
    `what` names the source in messages."""
    head_cfg = dict(head_cfg)
    head_type = head_cfg.pop("type")
    if head_type not in names():
        raise UserError(f"{what} holds an unknown head type '{head_type}'; known: {', '.join(names())}")
    if method(head_type).layered:  # a record from before heads had a `layer` option: the target family's own layer
        head_cfg["layer"] = recorded_layer(head_cfg)
    check_head_config(head_cfg, state, what)  # before building: a config claiming 100000 layers costs nothing
    target_vocab = target.model.get_output_embeddings().weight.shape[0]
    check_vocab_maps(state, head_cfg.get("vocab_size"), target_vocab, what)
    try:
        head = method(head_type).load("head")(target.model, **head_cfg, **_buffers_for_init(state))
    except ValueError as e:  # the builders' own checks of a config they cannot build
        raise UserError(f"{what} does not describe a '{head_type}' head this target can build: {e}") from e
    own = head.state_dict()
    for name, t in state.items():
        if name in own and own[name].shape != t.shape:
            raise UserError(f"{what}: tensor '{name}' has shape {list(t.shape)} but a '{head_type}' head of that "
                            f"config needs {list(own[name].shape)}; re-export it")
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        found = [f"{name} {', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''}"
                 for name, keys in (("missing", missing), ("no place for", unexpected)) if keys]
        raise UserError(f"{what} does not map onto selfspec's '{head_type}' head for target "
                        f"'{target.identity['name_or_path']}': {'; '.join(found)}")
    head.load_state_dict(state)
    head = head.to(target.model.device).eval()
    use_kernels(head, target.kernels)  # a loaded head decodes: its linears as the target's (target/kernels.py)
    return head


# Head config keys that count things, and the least each may be (None allowed where the head says "none").
COUNTS = {"num_layers": 1, "exit_layer": 1, "num_target_layers": 1, "rank": 1, "lora_rank": 1, "vocab_size": 1}
# Head config keys that list target layers (EAGLE-3's aux_layers, DFlash's target_layer_ids): integers >= 0.
LAYER_LISTS = ("aux_layers", "target_layer_ids")
# Head config keys that size weights -> the tensors whose first dimension is that size: layerskip's light adapter
# (`adapter.down.weight` [rank, H]) and its LoRA (`lora_A.<module>.weight` [lora_rank, in]).
SIZED = {"rank": ("adapter.down.weight", r"^adapter\.down\.weight$"),
         "lora_rank": ("lora_A.*.weight", r"^lora_A\..+\.weight$")}


def check_head_config(head_cfg: dict, state: dict[str, torch.Tensor], what: str) -> None:
    """The record's counts are integers in range, its layer lists lists of layer ids, and the sizes it states
    (layer count, adapter ranks) are the ones its weights hold: refused in one line before anything is built, so a
    record claiming rank 2**31 never allocates 549 GB."""
    import re

    for key, least in COUNTS.items():
        value = head_cfg.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise UserError(f"{what}: head config '{key}' must be an integer >= {least}, got {value!r}; re-export it")
    for key in LAYER_LISTS:
        ids = head_cfg.get(key)
        if ids is not None and (not isinstance(ids, list) or not all(isinstance(k, int) and not isinstance(k, bool)
                                                                      and k >= 0 for k in ids)):
            raise UserError(f"{what}: head config '{key}' must be a list of integers >= 0, got {ids!r}; re-export it")
    for key, (name, pattern) in SIZED.items():
        value = head_cfg.get(key)
        if value is None:
            continue
        held = sorted({t.shape[0] for k, t in state.items() if re.search(pattern, k) and t.dim() > 0})
        if not held:
            raise UserError(f"{what}: head config says {key}={value} but its weights hold no {name}; re-export it")
        if held != [value]:
            raise UserError(f"{what}: head config says {key}={value} but its weights hold {key} "
                            f"{', '.join(map(str, held))} ({name}); re-export it")
    layers = {int(m.group(1)) for k in state for m in [re.search(r"(?:^|\.)layers\.(\d+)\.", k)] if m}
    n = head_cfg.get("num_layers")
    if n is not None and layers and n != len(layers):
        raise UserError(f"{what}: head config says num_layers={n} but its weights hold {len(layers)} layer(s); "
                        "re-export it")


def _buffers_for_init(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Constructor inputs that live in the state dict (the draft vocabulary: EAGLE's `draft_vocab`, EAGLE-3's
    `d2t`/`t2d`), so it is never rebuilt."""
    return {k: state[k] for k in ("draft_vocab", "d2t", "t2d") if k in state}


def _download(repo_id: str, revision: Optional[str] = None) -> Path:
    """A published head (config.json, model.safetensors, README.md) at `revision` (None = main) through the Hub
    cache. Honours HF_HUB_OFFLINE, HF_HUB_CACHE, HF_ENDPOINT and the token like any huggingface_hub download;
    every failure is one line."""
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, HFValidationError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    try:
        return Path(huggingface_hub.snapshot_download(repo_id, revision=revision,
                                                      allow_patterns=[CONFIG_NAME, WEIGHTS_NAME, "README.md"]))
    except HFValidationError as e:
        raise UserError(f"'{repo_id}' is neither a file nor a valid Hub id ('<user>/<name>'); pass a head folder, "
                        "a .safetensors/.pt file or a Hub id") from e
    except GatedRepoError as e:
        raise UserError(f"Hub repo '{repo_id}' is gated: accept its terms on the Hub, then `hf auth login`") from e
    except RepositoryNotFoundError as e:
        raise UserError(f"Hub repo '{repo_id}' not found (or private: log in with `hf auth login` or set "
                        "HF_TOKEN)") from e
    except RevisionNotFoundError as e:
        if revision is not None:
            raise UserError(f"Hub repo '{repo_id}' has no revision '{revision}' (a branch, tag or commit of it)") from e
        raise UserError(f"Hub repo '{repo_id}' has no main branch yet (nothing published?)") from e
    except LocalEntryNotFoundError as e:  # nothing usable in the cache, and the Hub did not answer with the files
        cause = e.__cause__
        status = getattr(getattr(cause, "response", None), "status_code", None)
        if constants.HF_HUB_OFFLINE:
            why = "HF_HUB_OFFLINE is set (unset it, or download the head once online)"
        elif status is not None:
            why = (f"the Hub answered {status} "
                   f"({'log in with `hf auth login` or set HF_TOKEN' if status in (401, 403) else 'try again later'})")
        else:
            why = f"the Hub cannot be reached ({type(cause or e).__name__}: check the network or HF_ENDPOINT)"
        raise UserError(f"'{repo_id}' is not cached and {why}") from e
    except HfHubHTTPError as e:
        raise UserError(f"cannot download '{repo_id}' from the Hub: {' '.join(str(e).split())[:200]}") from e
    except Exception as e:  # the HTTP client's own connection errors (httpx's are not OSError subclasses)
        if not isinstance(e, OSError) and not is_transport_error(e):
            raise
        raise UserError(f"cannot download '{repo_id}' from the Hub ({type(e).__name__}: check the network or "
                        "HF_ENDPOINT; rerunning resumes the download)") from e

