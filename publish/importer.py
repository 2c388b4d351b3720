"""Importing draft heads trained elsewhere (the original EAGLE, speculators, SpecForge) as selfspec heads, so that
`load_head`, scripts/eval_heads.py and the decoders take them as they take heads trained here.

`imported_head(src, target, fmt)` reads a folder or weights file that selfspec did not write, maps its tensors onto
the head selfspec builds for `target` and loads them (every name and shape checked); `import_head` is the same as
(record, state); `write_import` saves the head as a selfspec head folder (atomic, under core/ownership.py's rule). The
record is heads.checkpoint.head_record's with the target's own identity (the one load_head checks), plus
`imported_from` = {layout, path, sha256 of the weights file}.

Layouts (`fmt`): each head type's method folder reads its own (methods/<type>/formats.py, registry Method.formats:
IMPORTERS, and the docstring that says which trainer's files each layout follows and how its target layers count):
the original EAGLE-1/2 folders (`eagle`), speculators configs of every type (`speculators`), SpecForge / SafeAILab
and z-lab folders (a layout named by its method). `known_layouts()` lists them all.

This file reads the files, tells the layout apart (`layout=auto`: formats.detectors()), and loads and records the head.

What the selfspec head would compute differently is refused in one line, with what: a config whose layer dimensions
differ from the target's, an EAGLE-1 input norm on layer 0 or HASS layernorms, EAGLE-3 norm_before_residual, any
tensor without a place in the head or missing from the checkpoint. A folder with selfspec.json is an export selfspec
wrote: it is read back with publish/export.py's read_export, its record (training, metrics) kept.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from selfspec.core.errors import UserError, reading
from selfspec.target.model import file_sha256
from selfspec.core.ownership import check_output, owned_dir
from selfspec.heads.checkpoint import HEAD_KIND, build_head, head_record, write_head_files
from selfspec.publish.export import read_export
from selfspec.publish.formats import detectors, importers, layouts as format_layouts
from selfspec.publish.formats.base import RECORD_NAME

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # looked for in this order in a src folder


def known_layouts() -> tuple[str, ...]:
    """auto, then every layout a method's importers read (registry order)."""
    return ("auto", *format_layouts())


def import_head(src: str | Path, target, fmt: str = "auto", config: Optional[str] = None,
                aux_layers: Optional[Sequence[int]] = None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(record, state) of the selfspec head `src` holds, for `target` (a target.model.Target)."""
    head = imported_head(src, target, fmt, config, aux_layers)
    return head.record, {k: v.detach().to("cpu") for k, v in head.state_dict().items()}


def imported_head(src: str | Path, target, fmt: str = "auto", config: Optional[str] = None,
                  aux_layers: Optional[Sequence[int]] = None):
    """The head built for `target` with `src`'s weights loaded, bound, in eval mode; `.record` is its record.
    `config` is a config.json given apart from the weights; `aux_layers` (HF hidden_states ids) the target layers
    an EAGLE-3 head reads, for checkpoints that do not say."""
    if fmt not in known_layouts():
        raise UserError(f"unknown layout '{fmt}'; use one of {', '.join(known_layouts())}")
    src = Path(src)
    weights = check_src(src, config)
    if src.is_dir() and (src / RECORD_NAME).exists():
        if fmt != "auto" or aux_layers is not None:  # its record says both: a second answer would be ignored
            raise UserError(f"'{src}' is an export selfspec wrote: its {RECORD_NAME} names the layout and the "
                            "layers it reads; drop layout= and aux_layers=")
        return _selfspec_export(src, weights, target)
    cfg = _read_config(src, config)
    tensors = _read_weights(weights)
    layout = fmt if fmt != "auto" else _detect(cfg, tensors, src)
    if layout != "speculators" and "speculators_model_type" in cfg:
        raise UserError(f"'{src}' is a speculators folder (speculators_model_type: {cfg['speculators_model_type']}); "
                        "use layout=speculators or auto")
    head_cfg, state = _map(layout, cfg, tensors, target, aux_layers, src)
    head = _load(head_cfg, state, target, src)
    head.record = head_record(head, target.identity, imported_from=_source(layout, src, weights))
    return head


def write_import(head, out: str | Path, overwrite: bool = False, inputs=()) -> Path:
    """Save an imported head as a selfspec head folder, built beside `out` and swapped in whole, under the
    ownership rule (core/ownership.py: only over a selfspec head, with overwrite=true, holding nothing else)."""
    with owned_dir(out, "out", HEAD_KIND, overwrite, inputs) as tmp:
        write_head_files(head, tmp, head.record)
    return Path(out)


def check_out(out: str | Path, overwrite: bool = False, inputs=()) -> None:
    """`out` must be new or empty, or (with overwrite) a selfspec head folder holding nothing else, and no input."""
    check_output(out, "out", HEAD_KIND, overwrite, inputs)


def check_src(src: str | Path, config: Optional[str] = None) -> Path:
    """The weights file of `src` (a folder or the file itself), and `config` a file if given: what a run can check
    before loading the target. Returns the weights file."""
    if config is not None and not Path(config).is_file():
        raise UserError(f"config '{config}' is not a file")
    return _weights_file(Path(src))


# ---------------------------------------------------------------------------------------------- reading


def _weights_file(src: Path) -> Path:
    if src.is_file():
        return src
    if not src.is_dir():
        raise UserError(f"src '{src}' not found: pass a head folder or its weights file")
    for name in WEIGHT_FILES:
        if (src / name).is_file():
            return src / name
    raise UserError(f"no weights in '{src}': expected {' or '.join(WEIGHT_FILES)} (or pass the weights file as src=)")


def _read_config(src: Path, config: Optional[str]) -> dict[str, Any]:
    """`config` if given, else the src folder's config.json, else {} (a bare weights file or an accelerate state
    folder: the dimensions are then checked by the tensors' shapes alone)."""
    path = Path(config) if config is not None else src / "config.json"
    if not path.is_file():
        return {}
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read '{path}' as JSON ({type(e).__name__})") from e
    if not isinstance(cfg, dict):
        raise UserError(f"'{path}' is not a config (a JSON object)")
    if cfg.get("library") == "selfspec":
        raise UserError(f"'{path}' belongs to a selfspec head already: load it as it is (head=...)")
    return cfg


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    """A state dict of tensors from safetensors or a weights-only torch file; nothing pickled is ever run."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with reading("weights file", path):
        if path.suffix == ".safetensors":
            with safe_open(str(path), "pt") as f:
                ours = "selfspec_config" in (f.metadata() or {})
            tensors = {} if ours else load_file(str(path))
        else:
            tensors = torch.load(path, map_location="cpu", weights_only=True)
            ours = isinstance(tensors, dict) and "selfspec_config" in tensors
    if ours:  # a run's ckpt.pt, a single-file head, a checkpoint's head.safetensors: a head with its record already
        run_head = path.parent / "head"
        also = f", or the run's head folder {run_head}" if (run_head / "config.json").is_file() else ""
        raise UserError(f"'{path}' is a head selfspec wrote (a training run's single-file head, with its record): "
                        f"there is nothing to import; use it as it is (head={path}{also})")
    if not isinstance(tensors, dict) or not tensors or not all(isinstance(v, torch.Tensor) for v in tensors.values()):
        raise UserError(f"'{path}' is not a state dict of tensors")
    if all(k.startswith("module.") for k in tensors):  # accelerate's save_state of a DDP-wrapped model
        tensors = {k.removeprefix("module."): v for k, v in tensors.items()}
    return tensors


def _detect(cfg: dict[str, Any], tensors: dict[str, torch.Tensor], src: Path) -> str:
    """The first layout of publish/formats detectors() whose test the folder passes."""
    for layout, test in detectors():
        if test(cfg, tensors):
            return layout
    raise UserError(f"cannot tell the layout of '{src}' (tensors {', '.join(sorted(tensors)[:3])}, ...); pass "
                    f"layout={'|'.join(format_layouts())}")


def _source(layout: str, src: Path, weights: Path) -> dict[str, Any]:
    return {"layout": layout, "path": str(src.resolve()), "sha256": file_sha256(weights)}


# ---------------------------------------------------------------------------------------------- mapping


def _map(layout: str, cfg: dict[str, Any], tensors: dict[str, torch.Tensor], target, aux_layers, src: Path):
    """-> (head config with its "type", state in selfspec's names), by the head type's importer (publish/formats
    importers()): a speculators folder names its head type, every other layout is one head type's."""
    every = importers()
    if layout == "speculators":
        head_type = cfg.get("speculators_model_type")
        if head_type is None:
            raise UserError(f"layout=speculators reads speculators_model_type from config.json; '{src}' has none: "
                            "pass config=")
        if not isinstance(head_type, str) or layout not in every.get(head_type, {}):  # a list is no key either
            known = ", ".join(t for t, layouts in every.items() if layout in layouts)
            raise UserError(f"'{src}': speculators_model_type {json.dumps(head_type)} cannot be imported (known: "
                            f"{known})")
    else:
        head_type = next(t for t, layouts in every.items() if layout in layouts)
    return every[head_type][layout](cfg, tensors, target, aux_layers, src)


# ---------------------------------------------------------------------------------------------- loading


def _load(head_cfg: dict[str, Any], state: dict[str, torch.Tensor], target, src: Path):
    """Build the head for `target` and load `state` into it (heads.checkpoint.build_head), after refusing
    non-finite weights: a diverged run's head would otherwise fail only when it drafts."""
    bad = [k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        raise UserError(f"'{src}': {bad[0]} holds NaN or inf; its training diverged")
    return build_head(head_cfg, state, target, f"'{src}'")


def _selfspec_export(src: Path, weights: Path, target):
    """A folder selfspec's own export wrote: read_export knows its record and layout exactly."""
    from selfspec.target.model import check_identity

    record, state = read_export(src)
    check_identity(record["target"], target.identity)
    head = _load(record["head"], state, target, src)
    extra = {k: v for k, v in record.items() if k not in ("format_version", "library", "head", "target")}
    extra["imported_from"] = _source("selfspec-export", src, weights)
    head.record = head_record(head, target.identity, **extra)
    return head
