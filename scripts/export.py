"""Export a trained head for a serving engine: vLLM (`eagle`, `speculators`), SGLang (`sglang`) or llama.cpp (`gguf`).

    python scripts/export.py head=outputs/eagle/head format=eagle out=exports/eagle-head
    python scripts/export.py head=<user>/<name> format=sglang out=exports/sglang-head dtype=bfloat16
    python scripts/export.py head=outputs/demo/eagle3/head format=gguf out=exports/head.gguf gguf_type=f32

Layouts and what each engine needs: heads/export.py. Heads an engine would serve wrong (an fc bias or a reduced
vocabulary in vLLM's EAGLE-1 loader) are refused with the reason. The folder also gets selfspec.json (the head's
record), so the export can be traced back to its run. `format=gguf` writes one file instead (EAGLE-3 and DFlash heads),
with the tokenizer of the target's GGUF (`target_gguf`; the embedded target's own by default). Every check runs
before anything is written, and files appear complete or not at all. Prints how to serve it, then one JSON line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional

from selfspec.heads.checkpoint import read_head
from selfspec.heads.vocab import full_vocabulary
from selfspec.core.cli import entry
from selfspec.core.errors import UserError
from selfspec.core.ownership import OWNER_FILE, check_output
from selfspec.publish.export import (DEFAULT_SPEC_TOKENS, EXPORT_KIND, FORMATS, GGUF_FORMAT, GGUF_KIND, GGUF_TYPES,
                                     check_target_config, convert, target_gguf_path, to_gguf, write_export, write_gguf)

PLACEHOLDER = "<"


@dataclass
class ExportConfig:
    head: str = field(default="<set head=FOLDER_OR_HUB_ID>", metadata={"help": (
        "The head: a folder, a single .safetensors/.pt file or a Hub id.")})
    format: str = field(default="eagle", metadata={"help": (
        'eagle (vLLM method "eagle" / original EAGLE), speculators (vLLM speculators config), sglang, gguf '
        '(llama.cpp).')})
    out: str = field(default="<set out=FOLDER>", metadata={"help": (
        "Folder to write (replaced whole, atomically); for format=gguf the .gguf file to write.")})
    num_speculative_tokens: int = field(default=DEFAULT_SPEC_TOKENS, metadata={"help": (
        "Draft tokens per step written into the speculators config / printed serving command (DFlash heads: "
        "always block_size - 1, what one draft pass proposes).")})
    dtype: Optional[str] = field(default=None, metadata={"help": (
        "Cast floating weights: null keeps the head's dtype (float32); bfloat16 halves the files.")})
    cache_dir: Optional[str] = field(default=None, metadata={"help": (
        "Where converted targets are cached (embedded targets: the target config is read from there).")})
    gguf_type: str = field(default="f32", metadata={"help": (
        "format=gguf: tensor type of the 2-D weights (f32, bf16, q8_0; norms and d2t keep F32/I64, as llama.cpp's "
        "converter does).")})
    expand_vocab: bool = field(default=False, metadata={"help": (
        "EAGLE-1 heads with a reduced draft vocabulary: drop the map and draft over the target's whole vocabulary "
        "(vLLM's EAGLE-1 loader has no map; the shipped head's held-out tau: 2.431 reduced, 2.444 full).")})
    target_gguf: Optional[str] = field(default=None, metadata={"help": (
        "format=gguf: the target's GGUF, whose tokenizer the draft copies (llama.cpp refuses a draft whose "
        "vocabulary differs from the target's); null = the embedded target's packaged GGUF.")})
    overwrite: bool = field(default=False, metadata={"help": (
        "format=gguf: replace an existing file at `out` that is not a GGUF draft selfspec wrote. An export folder "
        "replaces only an earlier export, never a folder holding other files (overwrite=true included).")})


def target_config_of(identity: dict, cache_dir: Optional[str] = None):
    """The HF config of the head's target, without loading its weights where avoidable."""
    from transformers import AutoConfig

    from selfspec.core.target import load_target, local_folder

    name = str(identity["name_or_path"])
    if name.startswith("tiny:"):
        return load_target(name).model.config  # a tiny random model: cheap, and its config is built in code
    folder = local_folder(name, cache_dir)
    try:
        return AutoConfig.from_pretrained(str(folder) if folder else name, revision=None if folder else identity.get("revision"))
    except OSError as e:
        raise UserError(f"cannot read the config of target '{name}' (needed for the export): "
                        f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from e


def export_gguf(cfg: ExportConfig) -> dict:
    """format=gguf: llama.cpp's EAGLE-3 or DFlash draft file (publish/export.py to_gguf / write_gguf)."""
    if cfg.gguf_type not in GGUF_TYPES:
        raise UserError(f"unknown gguf_type '{cfg.gguf_type}'; use one of {', '.join(GGUF_TYPES)}")
    if cfg.dtype is not None:
        raise UserError("format=gguf takes gguf_type=f32|bf16|q8_0, not dtype")
    inputs = [("head", cfg.head), ("target_gguf", cfg.target_gguf)]
    check_output(cfg.out, "out", GGUF_KIND, cfg.overwrite, inputs)  # before any work; again under the lock
    record, state = read_head(cfg.head)
    target_config = target_config_of(record["target"], cfg.cache_dir)
    check_target_config(record, target_config)
    export = to_gguf(record, state, target_config, cfg.gguf_type)
    out = write_gguf(export, record, cfg.out, target_gguf_path(record, cfg.target_gguf), cfg.overwrite, inputs)
    print(f"[export] gguf ({cfg.gguf_type}): {len(export.tensors)} tensors -> {out}")
    for line in export.usage:
        print("[export] serve: " + line.replace("<out>", str(out)))
    result = {"format": cfg.format, "out": str(out), "gguf_type": cfg.gguf_type,
              "tensors": {k: [qtype, list(v.shape)] for k, (v, qtype) in sorted(export.tensors.items())}}
    print(json.dumps(result), flush=True)
    return result


@entry("export", ExportConfig)
def main(cfg: ExportConfig) -> dict:
    for key in ("head", "out"):
        if str(getattr(cfg, key)).startswith(PLACEHOLDER):
            raise UserError(f"pass {key}=... (see `python scripts/export.py --cfg`)")
    if cfg.format not in (*FORMATS, GGUF_FORMAT):
        raise UserError(f"unknown format '{cfg.format}'; use one of {', '.join(FORMATS)}, {GGUF_FORMAT}")
    if cfg.format == GGUF_FORMAT:
        if cfg.expand_vocab:
            raise UserError("expand_vocab is for EAGLE-1 heads; format=gguf exports EAGLE-3 heads with their d2t map")
        return export_gguf(cfg)
    if cfg.num_speculative_tokens < 1:
        raise UserError("num_speculative_tokens must be >= 1")
    import torch

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if cfg.dtype is not None and cfg.dtype not in dtypes:
        raise UserError(f"unknown dtype '{cfg.dtype}'; use one of {', '.join(dtypes)} (or null)")
    inputs = [("head", cfg.head)]
    check_output(cfg.out, "out", EXPORT_KIND, cfg.overwrite, inputs)  # before any work; again under the lock
    record, state = read_head(cfg.head)
    if cfg.expand_vocab:
        record, state = full_vocabulary(record, state)
    export = convert(record, state, target_config_of(record["target"], cfg.cache_dir), cfg.format,
                     spec_tokens=cfg.num_speculative_tokens, dtype=dtypes.get(cfg.dtype or ""))
    out = write_export(export, record, cfg.out, cfg.overwrite, inputs)
    print(f"[export] {cfg.format}: {len(export.tensors)} tensors -> {out}")
    for line in export.usage:
        print("[export] serve: " + line.replace("<out>", str(out)))
    result = {"format": cfg.format, "out": str(out), "files": sorted(p.name for p in out.iterdir() if p.name != OWNER_FILE),
              "tensors": {k: list(v.shape) for k, v in sorted(export.tensors.items())}}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
