"""Exports and imports of heads, one module per head type behind one registry (plain dicts, as decode/drafters/).

    EXPORTERS[head_type][format]  -> converter: format eagle | speculators | sglang (an Export: a folder),
                                     gguf (a GGUFExport: one llama.cpp file)
    IMPORTERS[head_type][layout]  -> importer(cfg, tensors, target, aux_layers, src) -> (head config, state) of a
                                     checkpoint another trainer wrote (publish/importer.py)
    READERS[head_type]            -> read_back(record, tensors, folder) -> state of an export selfspec wrote
    DETECT                        -> (layout, test(cfg, tensors)) in the order `layout=auto` tries them

Each module (eagle.py: EAGLE-1, eagle3.py: EAGLE-3, dflash.py: DFlash, peagle.py: P-EAGLE) holds its head
type's layouts and refusals; base.py the pieces they share. A new head type is one new module and its lines here.
A format a head type has no converter for is refused with REFUSALS[format] (`exporter`): the same words whatever
the head type.
"""

from __future__ import annotations

from typing import Callable

from selfspec.core.errors import UserError
from selfspec.publish.formats import dflash, eagle, eagle3, peagle
from selfspec.publish.formats.base import is_speculators

FORMATS = ("eagle", "speculators", "sglang")  # export folders (publish/export.py convert)
GGUF_FORMAT = "gguf"  # one GGUF file (publish/export.py to_gguf, base.write_gguf)

EXPORTERS: dict[str, dict[str, Callable]] = {"eagle": eagle.EXPORTERS, "eagle3": eagle3.EXPORTERS,
                                             "dflash": dflash.EXPORTERS, "peagle": peagle.EXPORTERS}
IMPORTERS: dict[str, dict[str, Callable]] = {"eagle": eagle.IMPORTERS, "eagle3": eagle3.IMPORTERS,
                                             "dflash": dflash.IMPORTERS, "peagle": peagle.IMPORTERS}
READERS: dict[str, Callable] = {"eagle": eagle.read_back, "eagle3": eagle3.read_back, "dflash": dflash.read_back,
                                "peagle": peagle.read_back}
# A DFlash folder holds an fc and layers.* too, and an EAGLE-1 one no hidden_norm: DFlash first, EAGLE-1 last.
DETECT: list[tuple[str, Callable]] = [("dflash", dflash.detect), ("speculators", is_speculators),
                                      ("eagle3", eagle3.detect), ("eagle", eagle.detect)]
# Every layout an importer reads, in the order IMPORTERS names them.
LAYOUTS = tuple(dict.fromkeys(layout for layouts in IMPORTERS.values() for layout in layouts))

REFUSALS = {  # a format a head type has no converter for; {type} is the head's, {known} the types that have one,
    # {formats} the formats the head's type has
    "eagle": "format=eagle is the EAGLE-1 layout; a '{type}' head exports as format={formats}",
    "speculators": "format=speculators does not know head type '{type}' (known: {known})",
    "sglang": "format=sglang does not know head type '{type}' (known: {known})",
    "gguf": "format=gguf: llama.cpp's drafts are its EAGLE-3 and DFlash types; a '{type}' head has no GGUF layout "
            "(known: {known})",
}


def exporter(head_type: str, fmt: str) -> Callable:
    """The converter of `head_type` heads to `fmt`, or a one-line refusal."""
    convert = EXPORTERS.get(head_type, {}).get(fmt)
    if convert is None:
        known = ", ".join(t for t, formats in EXPORTERS.items() if fmt in formats)
        formats = "|".join(EXPORTERS.get(head_type, {})) or "(none)"  # P-EAGLE: speculators alone (SGLang has none)
        raise UserError(REFUSALS[fmt].format(type=head_type, known=known, formats=formats))
    return convert


def reader(head_type: str) -> Callable:
    """How an export of `head_type` heads maps back to a selfspec state, or a one-line refusal."""
    if head_type not in READERS:
        raise UserError(f"reading back '{head_type}' exports is not supported")
    return READERS[head_type]
