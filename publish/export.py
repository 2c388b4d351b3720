"""Exporting heads to the layouts serving engines load, and reading such exports back: the entry points.

`convert(record, state, target_config, fmt)` is pure: a selfspec head (its config.json record and state dict)
and the target's HF config in, an `Export` (config.json dict, tensors, extra files, serving hints) out.
`write_export` puts it on disk; `read_export` maps an export back to a selfspec (record, state). `to_gguf` and
`write_gguf` do the same for format=gguf, one llama.cpp file.

Layouts (format=): eagle (original EAGLE / vLLM `method: "eagle"`), speculators (the speculators config format,
`vllm serve <out>`), sglang (SGLang's draft model folders), gguf (llama.cpp). Which head type exports to which, and
the engine sources each layout follows: each method's formats.py (methods/<name>/formats.py, named by its registry
entry; publish/formats/__init__.py gathers them, base.py holds the shared pieces). What an engine would silently
serve wrong is refused there, with the reason, before anything is written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from selfspec.core.errors import UserError
from selfspec.publish.formats import FORMATS, GGUF_FORMAT, exporter, reader
# Also what callers (scripts/export.py, engines/, tests) import from here: the export API in one place.
from selfspec.publish.formats.base import (DEFAULT_SPEC_TOKENS, EXPORT_KIND, GGUF_KIND, GGUF_TYPES, RECORD_NAME, Export,
                                           GGUFExport, check_target_config, diff_gguf, read_export_folder,
                                           target_gguf_path, write_export, write_gguf)


def convert(record: dict[str, Any], state: dict[str, torch.Tensor], target_config, fmt: str,
            spec_tokens: int = DEFAULT_SPEC_TOKENS, dtype: Optional[torch.dtype] = None) -> Export:
    """Pick the converter; `dtype` casts floating tensors (e.g. bfloat16 halves the files)."""
    if fmt not in FORMATS:
        raise UserError(f"unknown format '{fmt}'; use one of {', '.join(FORMATS)}")
    check_target_config(record, target_config)
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    return exporter(record["head"]["type"], fmt)(record, state, target_config, spec_tokens=spec_tokens)


def to_gguf(record: dict[str, Any], state: dict[str, torch.Tensor], target_config, outtype: str = "f32") -> GGUFExport:
    """A head -> the keys and tensors of its llama.cpp draft GGUF (tokenizer not included: write_gguf copies it from
    the target's GGUF). Everything llama.cpp would load but serve wrong is refused."""
    return exporter(record["head"]["type"], GGUF_FORMAT)(record, state, target_config, outtype)


def read_export(folder: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """An export selfspec wrote (any layout) back to a selfspec (record, state); the record comes from
    selfspec.json, the state from the weights as the head type maps them back (publish/formats READERS)."""
    record, tensors = read_export_folder(folder)
    return record, reader(record["head"]["type"])(record, tensors, Path(folder))
