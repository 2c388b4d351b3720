"""Import an EAGLE, speculators or SpecForge head trained elsewhere as a selfspec head folder.

    selfspec import-head src=<EAGLE folder> target=hf target.name_or_path=lmsys/vicuna-7b-v1.3 out=heads/vicuna-eagle
    selfspec import-head src=ckpt/state_19 config=ckpt/config.json target=... out=heads/eagle   # accelerate state
    selfspec import-head src=<SpecForge output> aux_layers=[2,16,29] target=... out=heads/specforge-head

Layouts and the names each holds: each method's methods/<type>/formats.py (`layout=auto` tells them apart by
config.json and tensor names). The head is rebuilt for the target and every tensor checked by name and shape; the
checkpoint's config must state the target's dimensions. Every check runs before anything is written (an existing
`out` is replaced only with overwrite=true, and only if it holds a selfspec head), and the folder appears whole or
not at all. The result is a head like those trained here: `selfspec eval +heads.imported=<out>`, `selfspec generate
head=<out>`. Prints one JSON line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional

from selfspec.core.cli import entry
from selfspec.core.errors import UserError
from selfspec.target.model import TargetConfig, load_target_from_config
from selfspec.publish.importer import check_out, check_src, imported_head, known_layouts, write_import

PLACEHOLDER = "<"


@dataclass
class ImportHeadConfig:
    src: str = field(default="<set src=FOLDER_OR_WEIGHTS_FILE>", metadata={"help": (
        "The head to import: its folder (config.json + model.safetensors or pytorch_model.bin, or an accelerate "
        "save_state folder) or its weights file.")})
    target: TargetConfig = field(default_factory=TargetConfig)
    out: str = field(default="<set out=FOLDER>", metadata={"help": (
        "The selfspec head folder to write (atomically).")})
    layout: str = field(default="auto", metadata={"help": (
        "auto, or a layout a method's importers read (an unknown name lists them all): eagle (SafeAILab "
        "EAGLE-1/2, vLLM eagle), speculators (speculators EAGLE-1/EAGLE-3/DFlash), and a layout per method for "
        "SpecForge / SafeAILab / z-lab folders (methods/<type>/formats.py says which files each reads).")})
    config: Optional[str] = field(default=None, metadata={"help": (
        "The checkpoint's config.json, where it is not beside the weights (accelerate save_state folders); null = "
        "src's own config.json.")})
    aux_layers: Optional[list[int]] = field(default=None, metadata={"help": (
        "EAGLE-3: the target layers the head reads, as HF hidden_states ids (SGLang's eagle_config ids + 1), for "
        "checkpoints that do not name them; null = what the checkpoint says.")})
    overwrite: bool = field(default=False, metadata={"help": (
        "Replace `out` if it already holds a selfspec head (never a folder holding anything else: those files "
        "are never deleted).")})


@entry("import_head", ImportHeadConfig)
def main(cfg: ImportHeadConfig) -> dict:
    for key in ("src", "out"):
        if str(getattr(cfg, key)).startswith(PLACEHOLDER):
            raise UserError(f"pass {key}=... (see `selfspec import-head --help`)")
    if cfg.layout not in known_layouts():
        raise UserError(f"unknown layout '{cfg.layout}'; use one of {', '.join(known_layouts())}")
    check_src(cfg.src, cfg.config)  # before loading the target: a refused run costs nothing
    inputs = [("src", cfg.src), ("config", cfg.config)]
    check_out(cfg.out, cfg.overwrite, inputs)
    target = load_target_from_config(cfg.target)
    aux = None if cfg.aux_layers is None else [int(k) for k in cfg.aux_layers]
    head = imported_head(cfg.src, target, cfg.layout, cfg.config, aux)
    out = write_import(head, cfg.out, cfg.overwrite, inputs)
    record = head.record
    print(f"[import-head] {record['imported_from']['layout']} -> selfspec {record['head']['type']} head for "
          f"'{target.identity['name_or_path']}' -> {out}")
    result = {"out": str(out), "head": record["head"], "imported_from": record["imported_from"],
              "target": target.identity}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
