"""Exports and imports of heads: each method's formats module (methods/: Method.formats) behind these views.

    exporters()[head_type][format] -> converter: format eagle | speculators | sglang (an Export: a folder),
                                      gguf (a GGUFExport: one llama.cpp file)
    importers()[head_type][layout] -> importer(cfg, tensors, target, aux_layers, src) -> (head config, state) of a
                                      checkpoint another trainer wrote (publish/importer.py)
    readers()[head_type]           -> read_back(record, tensors, folder) -> state of an export selfspec wrote
    detectors()                    -> (layout, test(cfg, tensors)) in the order `layout=auto` tries them

A formats module holds its head type's EXPORTERS, IMPORTERS, read_back and (if a layout of its own names no head
type) detect; base.py the pieces they share. A format a head type has no converter for is refused with
REFUSALS[format] (`exporter`): the same words whatever the head type.
"""

from __future__ import annotations

from typing import Callable

from selfspec.core.errors import UserError
from selfspec.registry import exporting
from selfspec.publish.formats.base import is_speculators

FORMATS = ("eagle", "speculators", "sglang")  # export folders (publish/export.py convert)
GGUF_FORMAT = "gguf"  # one GGUF file (publish/export.py to_gguf, base.write_gguf)
SPECULATORS_RANK = 20  # `layout=auto` tries a speculators config (it names its head type) after ranks below this


def exporters() -> dict[str, dict[str, Callable]]:
    return {m.name: m.load("formats").EXPORTERS for m in exporting()}


def importers() -> dict[str, dict[str, Callable]]:
    return {m.name: m.load("formats").IMPORTERS for m in exporting()}


def readers() -> dict[str, Callable]:
    return {m.name: m.load("formats").read_back for m in exporting()}


def detectors() -> list[tuple[str, Callable]]:
    """(layout, test) by the methods' detect_rank, a speculators config at SPECULATORS_RANK."""
    ranked = [(m.detect_rank, m.name, m.load("formats").detect) for m in exporting()
              if hasattr(m.load("formats"), "detect")]
    ranked.append((SPECULATORS_RANK, "speculators", is_speculators))
    return [(layout, test) for _, layout, test in sorted(ranked, key=lambda r: r[0])]


def layouts() -> tuple[str, ...]:
    """Every layout an importer reads, in the order importers() names them."""
    return tuple(dict.fromkeys(layout for found in importers().values() for layout in found))


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
    every = exporters()
    convert = every.get(head_type, {}).get(fmt)
    if convert is None:
        known = ", ".join(t for t, formats in every.items() if fmt in formats)
        formats = "|".join(every.get(head_type, {})) or "(none)"  # P-EAGLE: speculators alone (SGLang has none)
        raise UserError(REFUSALS[fmt].format(type=head_type, known=known, formats=formats))
    return convert


def reader(head_type: str) -> Callable:
    """How an export of `head_type` heads maps back to a selfspec state, or a one-line refusal."""
    found = readers()
    if head_type not in found:
        raise UserError(f"reading back '{head_type}' exports is not supported")
    return found[head_type]
