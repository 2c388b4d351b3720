"""publish/formats/: each head type's formats module behind the methods registry (methods/). Every head type
selfspec trains is in it with the formats it exports to, every other format is refused in one line, and each entry
lives in its head type's module; publish/ has no import cycle between its files and no switch on a head's type outside
the registry."""

import ast
from pathlib import Path

import pytest

from selfspec.core.errors import UserError
from selfspec.registry import method, names
from selfspec.publish.formats import (FORMATS, GGUF_FORMAT, REFUSALS, detectors, exporter, exporters, importers, reader,
                                      readers)

ROOT = Path(__file__).resolve().parents[2]
PUBLISH = ROOT / "publish"
REGISTRY = PUBLISH / "formats" / "__init__.py"
# The model card describes each head type in words (each Method's card section and card.py's serve lines): text for
# the Hub page, not an export or import path; the only file here allowed to compare a head's type besides the registry.
CARD = PUBLISH / "card.py"

# What each head type selfspec trains exports to (tests/train/test_families.py exports each trained head);
# [] = no engine format (a LayerSkip exit is part of the target itself).
EXPORTS = {"eagle": ["eagle", "speculators", "sglang"], "eagle3": ["speculators", "sglang", "gguf"],
           "dflash": ["speculators", "sglang", "gguf"], "layerskip": [], "peagle": ["speculators"],
           "dspark": ["speculators", "sglang", "gguf"]}
# The words of each format's refusal (scripts/export.py prints them as they are).
REFUSED = {"eagle": "is the EAGLE-1 layout", "speculators": "does not know head type",
           "sglang": "does not know head type", "gguf": "has no GGUF layout"}


def test_every_trained_head_type_is_in_the_registry_with_its_formats():
    assert set(EXPORTS) == set(names())  # a new head type: say here what it exports to
    assert {t: sorted(exporters().get(t, {})) for t in names()} == {t: sorted(f) for t, f in EXPORTS.items()}
    exported = {t for t, f in EXPORTS.items() if f}
    assert set(readers()) == set(importers()) == exported  # what exports also reads its exports back and imports
    assert set(REFUSALS) == {*FORMATS, GGUF_FORMAT} and {layout for layout, _ in detectors()} == {
        layout for layouts in importers().values() for layout in layouts}


def test_each_entry_lives_in_its_head_types_module():
    """A new head type is one new module: nothing of one head type sits in another's file or in the registry."""
    for head_type in exporters():
        module = method(head_type).formats
        entries = [*exporters()[head_type].values(), *importers()[head_type].values(), readers()[head_type]]
        assert {f.__module__ for f in entries} == {module}, head_type


@pytest.mark.parametrize("head_type", sorted(EXPORTS))
def test_every_other_format_is_refused_in_one_line(head_type):
    for fmt in (*FORMATS, GGUF_FORMAT):
        if fmt in EXPORTS[head_type]:
            assert callable(exporter(head_type, fmt))
            continue
        with pytest.raises(UserError) as e:
            exporter(head_type, fmt)
        msg = str(e.value)
        assert msg.startswith(f"format={fmt}") and REFUSED[fmt] in msg and f"'{head_type}'" in msg and "\n" not in msg
    if not EXPORTS[head_type]:
        with pytest.raises(UserError, match=f"reading back '{head_type}' exports is not supported"):
            reader(head_type)


# ---------------------------------------------------------------------------------------------- the files


def _publish_files() -> dict[str, Path]:
    """Dotted module name -> file, for every file of publish/."""
    out = {}
    for path in PUBLISH.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(("selfspec", *(parts[:-1] if parts[-1] == "__init__" else parts)))] = path
    return out


def _arrows(path: Path, files: dict[str, Path]) -> set[Path]:
    """The publish/ files `path` imports, at module or function level: `from M import a` reads M.a where that is a
    file (a submodule), else M's own file."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                out.add(files.get(name) or files.get(node.module))
        elif isinstance(node, ast.Import):
            out.update(files.get(alias.name) for alias in node.names)
    return out - {None, path}


def test_publish_has_no_import_cycle():
    files = _publish_files()
    arrows = {path: _arrows(path, files) for path in files.values()}
    assert any(arrows.values())  # the walk sees the imports
    done: set[Path] = set()

    def visit(path: Path, stack: list[Path]) -> None:
        if path in stack:
            cycle = stack[stack.index(path):] + [path]
            raise AssertionError("import cycle: " + " -> ".join(str(p.relative_to(ROOT)) for p in cycle))
        if path in done:
            return
        for other in arrows[path]:
            visit(other, stack + [path])
        done.add(path)

    for path in sorted(arrows):
        visit(path, [])


def _reads_type(node: ast.AST) -> bool:
    """`x["type"]` or `x.get("type", ...)`: a head's type."""
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "type"
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
            and bool(node.args) and isinstance(node.args[0], ast.Constant) and node.args[0].value == "type")


def test_no_switch_on_head_type_outside_the_registry():
    found = []
    for path in sorted(PUBLISH.rglob("*.py")):
        if path in (REGISTRY, CARD):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Compare) and any(_reads_type(n) for n in (node.left, *node.comparators)):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []
