"""README.md and docs/guide.md (the rest of what the README once held) agree with the code: every repo path they
name exists, every relative link (README and docs/) reaches its file and heading, every `make X` is a Makefile target,
every `selfspec <command>` is in scripts/commands.py's table, and every `key=value` they hand a script names a key of
that script's config. All read as text or with ast:
nothing of selfspec is imported or run.

How a script maps to its config: its `@entry("<name>", <Schema>, [groups])` (core/cli.py) composes <name>.yaml (in
conf/, or in a method's own conf/) over the dataclass <Schema>; a key is valid if the dataclass (nested dataclasses,
bases, and the schemas of a config group such as `draft/`) has it, or if it lies under a free-form node (a dict field
such as `heads`). `group=option` names <group>/<option>.yaml in one of those folders. A failure names the README line.
"""

from __future__ import annotations

import ast
import fnmatch
import re
import shlex
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = (README, ROOT / "docs" / "guide.md")  # the front door and the guide it sends readers to: checked alike
CONF = ROOT / "conf"
CONFS = [CONF, *sorted((ROOT / "methods").glob("*/conf"))]  # core/cli.conf_dirs(), read as files
PLACEHOLDER = re.compile(r"[<>*{}$]")  # <folder>, heads/pretrained/*/*, tests/{a,b}, $(VAR): not literal paths
KEY = re.compile(r"^(\+\+|\+|~)?([A-Za-z_][\w]*(?:\.[\w]+)*)$")  # Hydra override key, with its +/++/~ prefix
FREE = {"dict", "Dict", "Any", "DictConfig", "Mapping"}  # annotations under which any key is a key


# ---------------------------------------------------------------------------------------------------------- README


def _lines(path: Path) -> list[str]:
    return path.read_text().split("\n")


@cache
def readme() -> tuple[list[tuple[str, str]], list[tuple[str, str]], list[tuple[str, str]]]:
    """(code-block lines, inline code spans, prose lines) of the README and of the guide it sends readers to
    (DOCS), each with its place `<file>:<1-based line>`. A code-block line ending in a backslash is joined with the
    next (a shell continuation)."""
    blocks, spans, prose = [], [], []
    for doc in DOCS:
        b, s, p = _parse(doc)
        blocks, spans, prose = blocks + b, spans + s, prose + p
    return blocks, spans, prose


def _parse(doc: Path) -> tuple[list[tuple[str, str]], list[tuple[str, str]], list[tuple[str, str]]]:
    name = doc.relative_to(ROOT)
    blocks, prose, fenced, pending = [], [], False, None
    for n, line in enumerate(_lines(doc), 1):
        where = f"{name}:{n}"
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            prose.append((where, line))
        else:
            pending = (pending[0], pending[1] + " " + line.strip()) if pending else (where, line)
            if pending[1].endswith("\\"):
                pending = (pending[0], pending[1][:-1])
            else:
                blocks.append(pending)
                pending = None
    text = "\n".join(line for _, line in prose)
    spans = []
    for m in re.finditer(r"`([^`]+)`", text):  # a span may wrap onto the next line
        spans.append((prose[text.count("\n", 0, m.start())][0], " ".join(m.group(1).split())))
    return blocks, spans, prose


def _commands() -> list[tuple[int, list[str]]]:
    """Every shell command of README's code blocks and inline code spans: (line, argv), env assignments and `time`
    dropped, `&&`/`;`/`|` separating commands."""
    blocks, spans, _ = readme()
    out = []
    for n, text in [*blocks, *spans]:
        try:
            tokens = shlex.split(text, comments=True)
        except ValueError:  # an unbalanced quote in prose: not a command
            continue
        command: list[str] = []
        for token in [*tokens, ";"]:
            if token in ("&&", "||", ";", "|", "&"):
                while command and (re.match(r"^[A-Z_][A-Z0-9_]*=", command[0]) or command[0] == "time"):
                    command.pop(0)
                if command:
                    out.append((n, command))
                command = []
            else:
                command.append(token)
    return out


# -------------------------------------------------------------------------------------------------- the repository


@cache
def ignored() -> list[str]:
    lines = (ROOT / ".gitignore").read_text().split("\n") if (ROOT / ".gitignore").exists() else []
    return [line.strip().strip("/") for line in lines if line.strip() and not line.startswith("#")]


@cache
def top_level() -> frozenset[str]:
    """The repository's top-level folders, less what git ignores (outputs/, .venv/, ...)."""
    return frozenset(p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")
                     and not any(fnmatch.fnmatch(p.name, pattern) for pattern in ignored()))


def _exists(path: str) -> bool:
    """A repo path, or `<module path>.<attribute>` (`target/model.embed`) whose module exists."""
    path = path.split("#")[0].split(":")[0].rstrip("/")
    if (ROOT / path).exists():
        return True
    stem, dot, _ = path.rpartition(".")
    return bool(dot) and "/" in stem and (ROOT / f"{stem}.py").is_file()


def _paths(text: str) -> list[str]:
    """Path-looking words of `text` that start at a top-level folder of the repo (`scripts/bench.py`, `docs/`)."""
    folders = "|".join(sorted(map(re.escape, top_level())))
    found = re.findall(rf"(?<![\w./~-])((?:{folders})/[^\s`'\"()\[\],;|]*)", text)
    return [p.rstrip(".") for p in found if not PLACEHOLDER.search(p)]


@cache
def makefile() -> tuple[set[str], set[str], dict[str, list[str]]]:
    """(targets, variables, recipe lines per target) of the Makefile, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", (ROOT / "Makefile").read_text())
    targets, variables, recipes, current = set(), set(), {}, None
    for line in text.split("\n"):
        variables.update(re.findall(r"\$\((\w+)\)", line))
        if line.startswith("\t"):
            if current:
                for target in current:
                    recipes.setdefault(target, []).append(line)
            continue
        if line.startswith("#") or not line.strip():
            continue
        if m := re.match(r"^(\w+)\s*(\?|:|\+)?=", line):
            variables.add(m.group(1))
            current = None
        elif m := re.match(r"^([^:#=]+?)\s*::?(?!=)", line):
            current = m.group(1).split()
            targets.update(current)
            if current == [".PHONY"]:
                targets.update(line.split(":", 1)[1].split())
                current = None
    return targets, variables, recipes


@cache
def commands() -> dict[str, str]:
    """scripts/commands.py's COMMANDS: subcommand -> module (its `train <method>` rows from registry.py)."""
    from selfspec.scripts.commands import COMMANDS

    return dict(COMMANDS)


def _module_file(module: str) -> Path:
    return ROOT / (module.removeprefix("selfspec.").replace(".", "/") + ".py")


# ------------------------------------------------------------------------------------------------ config schemas


@cache
def sources() -> dict[Path, ast.Module]:
    """The Python files of the package and the test harnesses that hold a schema or an entry point, parsed."""
    texts = {p: p.read_text() for folder in top_level() for p in (ROOT / folder).rglob("*.py")}
    return {p: ast.parse(text) for p, text in texts.items()
            if "dataclass" in text or "entry(" in text}


@cache
def dataclasses() -> dict[str, tuple[list[str], dict[str, ast.expr]]]:
    """dataclass name -> (base class names, {field: annotation})."""
    found = {}
    for tree in sources().values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(
                    "dataclass" in ast.unparse(d) for d in node.decorator_list):
                fields = {s.target.id: s.annotation for s in node.body
                          if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
                found.setdefault(node.name, ([ast.unparse(b) for b in node.bases], fields))
    return found


def _fields(name: str) -> dict[str, ast.expr]:
    bases, fields = dataclasses()[name]
    merged = {}
    for base in bases:
        if base in dataclasses():
            merged.update(_fields(base))
    return {**merged, **fields}


def _node(annotation: ast.expr) -> tuple[str, tuple[str, ...]]:
    """What a field holds: ("dc", dataclasses), ("free", ()) for dicts and Any, ("leaf", ()) otherwise."""
    names = {n.id for n in ast.walk(annotation) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(annotation) if isinstance(n, ast.Attribute)}
    names |= {n.value for n in ast.walk(annotation) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    classes = tuple(sorted(n for n in names if n in dataclasses()))
    if classes:
        return "dc", classes
    return ("free", ()) if names & FREE else ("leaf", ())


@cache
def entries() -> dict[str, tuple[str, dict[str, tuple[str, ...]]]]:
    """config name -> (schema dataclass, {group: option schemas}), from every `entry("<name>", Schema, groups)`."""
    found = {}
    for tree in sources().values():
        for call in ast.walk(tree):
            if not (isinstance(call, ast.Call) and getattr(call.func, "id", None) == "entry" and len(call.args) >= 2
                    and isinstance(call.args[0], ast.Constant) and isinstance(call.args[1], ast.Name)):
                continue
            groups = {}
            if (len(call.args) > 2 and isinstance(call.args[2], ast.Call)
                    and getattr(call.args[2].func, "id", None) == "draft_schemas"):
                # draft_schemas() -> {"draft": {"eagle_schema": EagleConfig, ...}}, each registered method's schema
                from selfspec.train.config import draft_schemas

                groups = {group: tuple(c.__name__ for c in schemas.values())
                          for group, schemas in draft_schemas().items()}
            found[call.args[0].value] = (call.args[1].id, groups)
    return found


def config_name(script: Path) -> str | None:
    """The config a script composes: its `entry("<name>", ...)`."""
    tree = sources().get(script) or ast.parse(script.read_text())
    for call in ast.walk(tree):
        if isinstance(call, ast.Call) and call.args and isinstance(call.args[0], ast.Constant):
            if getattr(call.func, "id", None) == "entry":
                return call.args[0].value
    return None


def key_problem(name: str, key: str, value: str) -> str | None:
    """Why `key=value` is not an override of config `name`, or None."""
    schema, groups = entries()[name]
    parts = key.split(".")
    if parts[0] == "hydra":
        return None
    if len(parts) == 1 and any((d / parts[0]).is_dir() for d in CONFS):  # a group choice: target=hf, draft=eagle3
        if value and not PLACEHOLDER.search(value) and not any((d / parts[0] / f"{value}.yaml").is_file()
                                                               for d in CONFS):
            return f"no {parts[0]}/{value}.yaml in conf/ or a method's conf/"
        return None
    node = ("dc", (schema,))
    for i, part in enumerate(parts):
        kind, classes = node
        if kind == "free":
            return None
        if kind == "leaf":
            return f"'{'.'.join(parts[:i])}' takes no keys (config {name}, schema {schema})"
        options = [c for c in classes if part in _fields(c)]
        if not options:
            return f"'{key}' is not a key of config {name} (schema {schema}; {name}.yaml)"
        node = ("dc", groups[part]) if i == 0 and part in groups else _node(_fields(options[0])[part])
    return None


def _script(argv: list[str]) -> Path | None:
    """The entry point a command runs: python/accelerate's `X.py` or `-m module`, `selfspec <command>`, and
    `tests/run_harness.py <name>`'s tests/harness/<name>.py."""
    if argv[0] == "selfspec":
        words = 2 if argv[1:2] == ["train"] else 1
        name = " ".join(argv[1:1 + words])
        return _module_file(commands()[name]) if name in commands() else None
    i = 1
    while i < len(argv):
        token = argv[i]
        if token == "-m" and i + 1 < len(argv):
            return _module_file(argv[i + 1])
        if token == "tests/run_harness.py" and i + 1 < len(argv):
            return ROOT / "tests" / "harness" / f"{argv[i + 1]}.py"
        if token.endswith(".py"):
            return ROOT / token
        if token.startswith("-") and "=" not in token and i + 1 < len(argv) and not argv[i + 1].startswith("-") \
                and not argv[i + 1].endswith(".py") and "=" not in argv[i + 1]:
            i += 1  # a launcher option's value: --config_file conf/accelerate/cpu_2proc.yaml
        i += 1
    return None


def _overrides(argv: list[str]) -> list[tuple[str, str, str]]:
    """(key, value, token) of each Hydra override in argv: key=value, +key=value, ++key=value, ~key."""
    out = []
    for token in argv:
        key, eq, value = token.partition("=")
        if (eq or key.startswith("~")) and not token.startswith("-") and (m := KEY.match(key)):  # ~key deletes
            out.append((m.group(2), value, token))
    return out


# ------------------------------------------------------------------------------------------------------- the tests


def test_paths_in_code_and_links_exist():
    blocks, spans, prose = readme()
    links = [(n, m) for n, line in prose for m in re.findall(r"\]\(([^)\s]+)\)", line)]
    problems = [f"{n}: {path} does not exist"
                for n, text in [*blocks, *spans, *links] for path in _paths(text) if not _exists(path)]
    assert not problems, "\n".join(problems)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    counts: dict[str, int] = {}
    found, fenced = set(), False
    for line in _lines(path):
        fenced ^= line.lstrip().startswith("```")
        if not fenced and (m := re.match(r"^#{1,6} (.+)$", line)):
            slug = _slug(m.group(1))
            found.add(f"{slug}-{counts[slug]}" if slug in counts else slug)  # GitHub: x, x-1, x-2, ...
            counts[slug] = counts.get(slug, 0) + 1
    return frozenset(found)


def test_relative_links_reach_their_file_and_heading():
    problems = []
    for doc in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        fenced = False
        for n, line in enumerate(_lines(doc), 1):
            fenced ^= line.lstrip().startswith("```")
            for target in [] if fenced else re.findall(r"\]\(([^)\s]+)\)", line):
                if re.match(r"^[a-z]+:", target):  # https:, mailto:
                    continue
                file, _, anchor = target.partition("#")
                path = (doc.parent / file).resolve() if file else doc
                where = f"{doc.relative_to(ROOT)}:{n}: ({target})"
                if not path.exists():
                    problems.append(f"{where}: {file} does not exist")
                elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                    problems.append(f"{where}: {path.relative_to(ROOT)} has no heading #{anchor}")
    assert not problems, "\n".join(problems)


def test_make_targets_and_variables_exist():
    targets, variables, _ = makefile()
    problems = []
    for n, argv in _commands():
        if argv[0] != "make":
            continue
        for token in argv[1:]:
            var, eq, _ = token.partition("=")
            if eq and var not in variables:
                problems.append(f"{n}: `make ... {token}`: the Makefile has no variable {var}")
            elif not eq and not token.startswith("-") and token not in targets:
                problems.append(f"{n}: `make {token}`: the Makefile has no target {token}")
    assert not problems, "\n".join(problems)


def test_selfspec_subcommands_exist():
    problems = []
    for n, argv in _commands():
        if argv[0] != "selfspec" or len(argv) < 2 or argv[1].startswith("-"):
            continue
        words = 2 if argv[1] == "train" else 1
        name = " ".join(argv[1:1 + words])
        if name not in commands():
            problems.append(f"{n}: `selfspec {name}` is not in scripts/commands.py's COMMANDS")
    assert not problems, "\n".join(problems)


def test_overrides_name_keys_of_their_scripts_config():
    _, _, recipes = makefile()
    problems, checked = [], 0
    for n, argv in _commands():
        jobs = []  # (script, overrides)
        if argv[0] == "make":  # SERVE_BENCH_ARGS="engines=[...]": to the script the target's recipe passes it to
            for var, value in (t.split("=", 1) for t in argv[1:] if "=" in t):
                lines = [line for target in argv[1:] for line in recipes.get(target, []) if f"$({var})" in line]
                scripts = {m for line in lines for m in re.findall(r"(\S+\.py)\b", line)}
                if "=" in value and len(scripts) == 1:
                    jobs.append((ROOT / scripts.pop(), _overrides(shlex.split(value))))
        elif argv[0] in ("python", "python3", "accelerate", "selfspec") and len(argv) > 1:
            script = _script(argv)
            if script is not None:
                jobs.append((script, _overrides(argv[1:])))
        for script, overrides in jobs:
            if not script.is_file():
                problems.append(f"{n}: {script.relative_to(ROOT)} does not exist")
                continue
            name = config_name(script)
            if name is None or name not in entries():
                if overrides:
                    problems.append(f"{n}: {script.relative_to(ROOT)} has no `entry(...)` config")
                continue
            for key, value, token in overrides:
                checked += 1
                if (why := key_problem(name, key, value)) is not None:
                    problems.append(f"{n}: `{token}` ({script.relative_to(ROOT)}): {why}")
    assert not problems, "\n".join(problems)
    assert checked > 50, f"only {checked} overrides found in README.md and the guide: is the parser still reading them?"


def test_help_comment_lists_every_subcommand():
    blocks = readme()[0]
    at = next(i for i, (_, text) in enumerate(blocks) if text.startswith("selfspec --help"))
    comment = blocks[at][1].split("#", 1)[1]
    for _, text in blocks[at + 1:]:  # the comment's continuation lines
        if not text.lstrip().startswith("#"):
            break
        comment += " " + text.split("#", 1)[1]
    listed = set(re.findall(r"[a-z][\w-]*", comment))
    trains = set(re.search(r"train ([\w|]+)", comment).group(1).split("|"))
    missing = [c for c in commands() if (c.split()[1] not in trains if c.startswith("train ") else c not in listed)]
    assert not missing, f"{blocks[at][0]}: `selfspec --help`'s comment does not list {missing}"


def test_layout_names_every_tool_and_doc():
    layout = "\n".join(line for _, line in readme()[2] if line.startswith("| `scripts/`") or
                       line.startswith("| `docs/`"))
    tools = [p for p in (ROOT / "scripts").iterdir() if p.suffix in (".py", ".sh") and p.name != "__init__.py"]
    docs = [p for p in (ROOT / "docs").iterdir() if p.suffix in (".md", ".png")]
    missing = [f"{p.parent.name}/{p.name}" for p in [*tools, *docs]
               if f"`{p.stem}`" not in layout and p.name not in layout]
    assert not missing, f"the layout table (scripts/ and docs/ rows, README or guide) does not name {sorted(missing)}"


def test_pip_extras_exist():
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    extras = set(re.findall(r"^(\w+)\s*=", section, re.M))
    problems = [f"{n}: pip extra [{e}] is not in pyproject.toml" for n, argv in _commands()
                if argv[0] == "pip" for token in argv for e in re.findall(r"\.\[([\w,]+)\]", token)
                if not set(e.split(",")) <= extras]
    assert not problems, "\n".join(problems)
