"""The README's import map is the code's: an AST walk of every `selfspec.*` import (module and function level) in
each room, and of every string that is a `selfspec.*` module name (what importlib imports: the `selfspec` command's
table), gives exactly the arrows the README draws, and no script imports another script (#33: scripts are thin
entry points; what two scripts share lives in a library module)."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROOMS = ("core", "target", "data", "decode", "eval", "heads", "methods", "publish", "engines", "train", "scripts")
MODULE = re.compile(r"selfspec(\.\w+)+")  # a whole string that names a module: "selfspec.methods.eagle.train"


def _imports(path: Path) -> set[str]:
    """Dotted module names a file imports (absolute `selfspec.*` ones, and bare ones)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def _named(path: Path) -> set[str]:
    """`selfspec.*` module names a file holds as whole strings (prose that mentions one is not a name)."""
    return {node.value for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE.fullmatch(node.value)}


def _code_map() -> dict[str, set[str]]:
    arrows = {room: set() for room in ROOMS}
    for room in ROOMS:
        for path in (ROOT / room).rglob("*.py"):
            for name in _imports(path) | _named(path):
                parts = name.split(".")
                if parts[0] == "selfspec" and len(parts) > 1 and parts[1] in ROOMS and parts[1] != room:
                    arrows[room].add(parts[1])
    return arrows


def _readme_map() -> dict[str, set[str]]:
    block = re.search(r"Imports follow it.*?```\n(.*?)```", (ROOT / "docs" / "guide.md").read_text(), re.S).group(1)
    arrows = {room: set() for room in ROOMS}
    for line in block.strip().splitlines():
        room, targets = (s.strip() for s in line.split("->"))
        arrows[room] = {t.strip() for t in targets.split(",")}
    return arrows


def test_readme_import_map_is_the_codes():
    assert _code_map() == _readme_map()


def test_core_imports_no_room_and_no_shared_room_imports_a_method():
    arrows = _code_map()
    assert arrows["core"] == set()  # nor names one by string: the `selfspec` command's table is in scripts/
    assert [room for room, targets in arrows.items() if "scripts" in targets] == []
    # the recipes (methods/<name>/train.py) and the profiler run the loop; the shared rooms below reach a method's
    # code only through registry.py's names, so a new method is its folder and one registry entry
    assert [room for room, targets in arrows.items() if "train" in targets] == ["methods", "scripts"]
    assert [room for room, targets in arrows.items() if "methods" in targets] == ["scripts"]


def test_no_script_imports_another_script():
    # the `selfspec` command (scripts/commands.py) names the scripts as strings and imports only the one it runs
    scripts = {p.stem for p in (ROOT / "scripts").glob("*.py") if not p.stem.startswith("_")}
    offenders = []
    for path in (ROOT / "scripts").glob("*.py"):
        for name in _imports(path):
            parts = name.split(".")
            if (parts[:2] == ["selfspec", "scripts"] and len(parts) > 2 and parts[2] in scripts) \
                    or (len(parts) == 1 and parts[0] in scripts - {path.stem}):
                offenders.append(f"{path.name} imports {name}")
    assert offenders == []
