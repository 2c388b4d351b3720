"""Export a trained head for a serving engine: vLLM (`eagle`, `speculators`), SGLang (`sglang`) or llama.cpp (`gguf`).

    python scripts/export.py head=outputs/eagle/head format=eagle out=exports/eagle-head
    python scripts/export.py head=<user>/<name> format=sglang out=exports/sglang-head dtype=bfloat16
    python scripts/export.py head=heads/pretrained/smollm2-135m-dflash format=gguf out=exports/head.gguf gguf_type=f32
    python scripts/export.py head=outputs/mine/head format=eagle out=exp target=hf target.name_or_path=/models/mine

The engines' layer config is the target's: the target named with `target=` (a folder or Hub id: `target=hf
target.name_or_path=...`; `target=tiny-llama`...), else the one the head records if that names no path on this
machine (a Hub id, `tiny:`, `embedded:`); a head trained on a local folder needs `target=` (a head is a file handed
to the export: the path it records is never read). The target named is checked against the head's record (hidden
size, layers, vocabulary) and is the one the export names as its verifier.
Layouts and what each engine needs: publish/formats/ (one module per head type). Heads an engine would serve wrong
(an fc bias or a reduced vocabulary in vLLM's EAGLE-1 loader) are refused with the reason. The folder also gets
selfspec.json (the head's record), so the export can be traced back to its run. `format=gguf` writes one file
instead (EAGLE-3 and DFlash heads), with the tokenizer of the target's GGUF (`target_gguf`; the embedded target's own
by default). Every check runs before anything is written, and files appear complete or not at all. Prints how to
serve it, then one JSON line.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from selfspec.heads.checkpoint import read_head
from selfspec.heads.vocab import full_vocabulary
from selfspec.core.cli import entry
from selfspec.core.errors import UserError
from selfspec.core.ownership import OWNER_FILE, check_output
from selfspec.target.model import TargetConfig
from selfspec.publish.export import (DEFAULT_SPEC_TOKENS, EXPORT_KIND, FORMATS, GGUF_FORMAT, GGUF_KIND, GGUF_TYPES,
                                     check_target_config, convert, target_gguf_path, to_gguf, write_export, write_gguf)

PLACEHOLDER = "<"
RECORDED = "<the target the head records>"  # target.name_or_path's default: a name (never a path) the head records


@dataclass
class ExportConfig:
    head: str = field(default="<set head=FOLDER_OR_HUB_ID>", metadata={"help": (
        "The head: a folder, a single .safetensors/.pt file or a Hub id.")})
    format: str = field(default="eagle", metadata={"help": (
        'eagle (vLLM method "eagle" / original EAGLE), speculators (vLLM speculators config), sglang, gguf '
        '(llama.cpp).')})
    out: str = field(default="<set out=FOLDER>", metadata={"help": (
        "Folder to write (replaced whole, atomically); for format=gguf the .gguf file to write.")})
    target: TargetConfig = field(default_factory=lambda: TargetConfig(name_or_path=RECORDED))
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


def export_target(record: dict, target: TargetConfig) -> tuple[dict, TargetConfig]:
    """(the record the export carries, the target whose config it copies): the target the user names, else the one
    the record names if that is a name, not a path on this machine. A named target becomes the record's (the
    export's verifier), its shapes still checked against the head's (publish/formats/base.py check_target_config)."""
    if target.name_or_path != RECORDED:
        if str(target.name_or_path).startswith(PLACEHOLDER):
            raise UserError("pass target.name_or_path=<the target's folder or Hub id> with target=hf")
        named = {"name_or_path": target.name_or_path, "revision": target.revision}
        return {**record, "target": {**record["target"], **named}}, target
    name = str(record["target"].get("name_or_path"))
    if not _a_name(name):
        raise UserError(f"the head records its target as '{name}', a path on this machine, and the export reads no "
                        "path a head names: pass the target it was trained for, target=hf target.name_or_path=<its "
                        "folder or Hub id>")
    return record, TargetConfig(name_or_path=name, revision=record["target"].get("revision"),
                                cache_dir=target.cache_dir)


def _a_name(name: str) -> bool:
    """A target name that reads nothing on this machine but a cache: `tiny:`, `embedded:` or a Hub id (`<org>/<name>`
    or a bare name) that is no local path."""
    if name.startswith(("tiny:", "embedded:")):
        return True
    return (re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?", name) is not None and ".." not in name
            and not Path(name).expanduser().exists())


def target_config_of(target: TargetConfig, cache_dir: Optional[str] = None):
    """The HF config of the target, without loading its weights where avoidable."""
    from transformers import AutoConfig

    from selfspec.target.model import load_target, local_folder

    name = str(target.name_or_path)
    if name.startswith("tiny:"):  # a tiny random model: cheap, and its config is built in code
        return load_target(name, seed=target.seed, tiny=dict(target.tiny) if target.tiny else None).model.config
    folder = local_folder(name, target.cache_dir or cache_dir)
    try:
        return AutoConfig.from_pretrained(str(folder) if folder else name, revision=None if folder else target.revision,
                                          trust_remote_code=False)
    except (OSError, ValueError) as e:  # ValueError: no model_type transformers ships, or a config of its own code
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
    record, target = export_target(record, cfg.target)
    target_config = target_config_of(target, cfg.cache_dir)
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
    record, target = export_target(record, cfg.target)
    if cfg.expand_vocab:
        record, state = full_vocabulary(record, state)
    export = convert(record, state, target_config_of(target, cfg.cache_dir), cfg.format,
                     spec_tokens=cfg.num_speculative_tokens, dtype=dtypes.get(cfg.dtype or ""))
    out = write_export(export, record, cfg.out, cfg.overwrite, inputs)
    print(f"[export] {cfg.format}: {len(export.tensors)} tensors -> {out}")
    for line in export.usage:
        print("[export] serve: " + line.replace("<out>", str(out)))
    result = {"format": cfg.format, "out": str(out),
              "files": sorted(p.name for p in out.iterdir() if p.name != OWNER_FILE),
              "tensors": {k: list(v.shape) for k, v in sorted(export.tensors.items())}}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
