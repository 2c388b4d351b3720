"""Entry-point plumbing shared by every script: compose the Hydra config, turn bad input into one line.

Every entry point is `@entry("<config name>", <schema dataclass>)` over a `main(cfg)`. Overrides use Hydra's
grammar (`key=value`, `group=option`, `+new=1`); `--cfg` prints the composed config and exits; `-h`/`--help`
prints every config field with its type, value and help text (the `metadata={"help": ...}` of the schema
dataclasses' fields) and exits. Errors print one line `error: ...` to stderr and exit 2 (user error, a file system's
refusal the user can fix included: a full disk, a read-only folder) or 1 (bug); `SELFSPEC_DEBUG=1` re-raises with
the traceback instead. We compose with Hydra's compose API rather than `@hydra.main` because the latter prints
multi-line reports for a mistyped key. A Ctrl-C exits 130 with one line: `error: interrupted`, or, once the work is
done (`outputs_complete`), a line naming the complete outputs; a SIGTERM ends a command the same way (its temp files
removed, its locks released), `error: terminated`, exit 143. A command that writes one output file (a report,
generate's rows) writes it and its config through `owned_output`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import signal
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn, Optional

from selfspec.core.errors import UserError

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
METHODS_DIR = CONF_DIR.parent / "methods"  # each method's folder may hold a conf/ of its own (its recipe, its draft=)
DEBUG_ENV = "SELFSPEC_DEBUG"
HELP_FLAGS = ("-h", "--help")


def register(name: str, schema: type, groups: dict[str, dict[str, type]] | None = None) -> None:
    """Make `schema` the typed base of the primary config `name` (its YAML lists `<name>_schema` first), and
    store the schemas of group options (`groups={"draft": {"eagle_schema": EagleConfig}}`)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name=f"{name}_schema", node=schema)
    for group, nodes in (groups or {}).items():
        for node_name, node in nodes.items():
            cs.store(group=group, name=node_name, node=node)


def conf_dirs() -> list[Path]:
    """Where configs live: conf/ (the shared groups and the tools' primary configs), then every method folder's own
    conf/ (its recipe's primary config `train_<name>.yaml` and its `draft/<name>.yaml`), searched as one tree."""
    return [CONF_DIR, *sorted(METHODS_DIR.glob("*/conf"))]


def primary_dir(name: str) -> Optional[Path]:
    """The folder of conf_dirs() that holds the primary config `<name>.yaml`, or None (a schema alone)."""
    return next((d for d in conf_dirs() if (d / f"{name}.yaml").is_file()), None)


def compose_config(name: str, overrides: list[str], return_hydra_config: bool = False):
    """Compose <name>.yaml (from conf_dirs()) with overrides; raises UserError with a one-line reason.
    `return_hydra_config` keeps the `hydra` node (its runtime.choices name the option picked in each group)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    main = primary_dir(name) or CONF_DIR  # Hydra finds a primary config in its main folder only
    search = "hydra.searchpath=[" + ",".join(f"'file://{d}'" for d in conf_dirs() if d != main) + "]"
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(str(main), version_base="1.3"):
            cfg = compose(config_name=name, overrides=[search, *overrides], return_hydra_config=return_hydra_config)
    except (HydraException, OmegaConfBaseException) as e:
        raise UserError(_config_error(e)) from e
    check_composed(cfg)
    return cfg


def check_composed(node, prefix: str = "") -> None:
    """What composing lets through but a run cannot use, refused in one line before the run starts: a value whose
    `${...}` does not resolve (OmegaConf resolves it when it is first read, mid-run), and a key that `+key=value`
    added to a typed node whose schema lacks it (nothing reads it: the setting would be ignored without a word).
    Free-form nodes (dict fields such as `heads`, `target.tiny`) take any key."""
    from omegaconf import DictConfig, ListConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    schema = OmegaConf.get_type(node) if isinstance(node, DictConfig) else None
    fields = {f.name for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else None
    for key in (node.keys() if isinstance(node, DictConfig) else range(len(node))):
        full = f"{prefix}{key}"
        if full == "hydra" or OmegaConf.is_missing(node, key):  # Hydra's own node; `???` is the schema's to report
            continue
        if fields is not None and key not in fields:
            raise UserError(_added_key(full, schema.__name__))
        try:
            child = node[key]  # resolves its interpolation, if any
        except OmegaConfBaseException as e:
            raw = OmegaConf.to_container(node, resolve=False)[key]
            reason = str(e).strip().splitlines()[0].removeprefix("KeyError raised while resolving interpolation: ")
            raise UserError(f"cannot resolve {full}={raw}: {reason.strip(chr(34))}; pass the value itself (`${{...}}` "
                            "reads another config key, or with oc.env an environment variable)") from e
        if isinstance(child, (DictConfig, ListConfig)):
            check_composed(child, f"{full}.")


def read_once(node, schema: type):
    """A composed config group (`cfg.train`, `cfg.data`, a recipe's loss group) as an instance of its schema dataclass
    `schema`, its values read once where the run settles them; an instance passes as it is. Code below the recipe
    then reads plain values: a DictConfig resolves every read anew, and ties each layer it reaches to the config
    tree."""
    if isinstance(node, schema):
        return node
    from omegaconf import OmegaConf

    values = OmegaConf.to_object(node)  # the schema's instance for a typed node, a dict for an untyped one
    return values if isinstance(values, schema) else schema(**values)


def refuse_renamed(overrides: list[str], renamed: dict[str, str]) -> None:
    """A key the schema has renamed (its RENAMED class attribute: old -> new key), refused in one line naming the new
    one: Hydra alone would only call it unknown."""
    for arg in overrides:
        key, eq, value = arg.partition("=")
        key = key.lstrip("+~")
        if key in renamed:
            raise UserError(f"config key '{key}' is now {renamed[key]}: pass {renamed[key]}={value if eq else '...'}")


def _added_key(key: str, schema: str) -> str:
    if key.rsplit(".", 1)[-1] == "trust_remote_code":
        return (f"{key} is not a selfspec setting: selfspec never runs a model's own code (config.json auto_map), so "
                "there is nothing to trust; drop it (a target whose model_type transformers ships loads without it)")
    return (f"config key '{key}' is not a setting of {schema}: nothing reads it; drop it or fix its name (`--cfg` "
            "prints every valid key; `+key=value` adds keys only under free-form nodes such as heads or target.tiny)")


def entry(config_name: str, schema: type | None = None, groups: dict[str, dict[str, type]] | None = None) -> Callable:
    """Decorate `main(cfg)` into a CLI entry point (see the module docstring)."""

    def decorate(fn: Callable[[Any], Any]) -> Callable[[], Any]:
        @functools.wraps(fn)
        def run(argv: list[str] | None = None, prog: str | None = None, program: bool | None = None):
            """`prog` names the command in the usage line (`selfspec train eagle`); default `python -m <module>`.
            `program`: this call is the whole process (the `selfspec` command; by default, `fn` runs as __main__:
            a script run by path or -m), so once the work is done it ends the process itself (end_program)."""
            program = fn.__module__ == "__main__" if program is None else program
            if schema is not None:
                register(config_name, schema, groups)
            args = list(sys.argv[1:] if argv is None else argv)
            show = "--cfg" in args
            args = [a for a in args if a != "--cfg"]
            if any(a in HELP_FLAGS for a in args):
                doc = getattr(sys.modules.get(fn.__module__), "__doc__", None)
                text = help_text(config_name, [a for a in args if a not in HELP_FLAGS], prog or _prog(fn), doc, schema,
                                 groups)
                try:
                    print(text, flush=True)
                except BrokenPipeError:  # `--help | head`: the reader has what it wanted
                    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                return None
            _DONE.clear()
            done = False
            _terminate_as_interrupt()
            try:
                refuse_renamed(args, getattr(schema, "RENAMED", {}))
                cfg = compose_config(config_name, [literal_data(a) for a in args])
                if show:
                    from omegaconf import OmegaConf

                    print(OmegaConf.to_yaml(cfg))
                    return None
                result = fn(cfg)
                outputs_complete()  # unless `fn` said so (and named them) already
                done = True
            except Terminated:
                _close_progress_bars()
                print("error: terminated", file=sys.stderr)
                sys.exit(143)
            except KeyboardInterrupt:
                _close_progress_bars()
                print("error: interrupted", file=sys.stderr)
                sys.exit(130)
            except UserError as e:
                if os.environ.get(DEBUG_ENV):
                    raise
                _close_progress_bars()
                print(f"error: {one_line(e)}", file=sys.stderr)
                sys.exit(2)
            except OSError as e:  # the file system said no: which path, why, and what to do
                if os.environ.get(DEBUG_ENV):
                    raise
                _close_progress_bars()
                print(f"error: {os_error(e)}", file=sys.stderr)
                sys.exit(2 if _os_hint(e) else 1)  # a full disk, a read-only folder: the user's to fix
            except Exception as e:  # a bug or an environment failure: still one line unless debugging
                if os.environ.get(DEBUG_ENV):
                    raise
                _close_progress_bars()
                print(f"error: {type(e).__name__}: {one_line(e)} (rerun with {DEBUG_ENV}=1 for the traceback)",
                      file=sys.stderr)
                sys.exit(1)
            finally:  # output locks end with the command (a refused run's new, empty output folder goes with them)
                from selfspec.core.atomic import release_locks

                release_locks()
                if not done:
                    _restore_interrupts()
            if program:
                end_program(0)
            _restore_interrupts()  # called in-process (tests): the caller's Ctrl-C handling again
            if _DONE.get("interrupted"):
                print(_interrupted_line(), file=sys.stderr)
                sys.exit(130)
            return result

        return run

    return decorate


_DONE: dict[str, Any] = {}  # the running command's outputs_complete: "what", "interrupted", "previous" handler


def outputs_complete(what: str = "") -> None:
    """Say that the command's outputs are complete (`what` names them: "r/head, r/ckpt.pt"). From here a
    Ctrl-C stops nothing half-done, so it is held until the command's cleanup (trackers, workers, locks, exit
    handlers) has run, then the command exits 130 with one line saying the outputs are complete; a second Ctrl-C
    exits so at once. The entry point says it for every command whose function returns; a command that has more
    to do after writing its outputs (closing trackers) says it as soon as they are written."""
    if "what" in _DONE:
        return
    _DONE["what"] = what
    try:
        _DONE["previous"] = signal.signal(signal.SIGINT, _late_interrupt)
        if "sigterm" in _DONE:  # a SIGTERM from here on is held the same way
            signal.signal(signal.SIGTERM, _late_interrupt)
    except ValueError:  # not the main thread, the only one Python runs signal handlers in: nothing to hold there
        pass


def _late_interrupt(signum, frame) -> None:
    if _DONE.get("interrupted"):
        _exit_interrupted()
    _DONE["interrupted"] = True


def _interrupted_line() -> str:
    what = _DONE.get("what")
    return f"error: interrupted after the work was done: every output is complete{f' ({what})' if what else ''}"


def _exit_interrupted() -> NoReturn:
    from selfspec.core.atomic import release_locks

    release_locks()
    _close_progress_bars()
    print(_interrupted_line(), file=sys.stderr)
    _flush()
    os._exit(130)


def _restore_interrupts() -> None:
    if "previous" in _DONE:
        signal.signal(signal.SIGINT, _DONE.pop("previous"))
    if "sigterm" in _DONE:
        signal.signal(signal.SIGTERM, _DONE.pop("sigterm"))


class Terminated(KeyboardInterrupt):
    """SIGTERM (`kill`, a scheduler's stop): raised where the command is, so it ends as a Ctrl-C does (temp files
    removed, locks released) and says so in one line, exit 143, instead of dying where it stood."""


def _terminated(signum, frame) -> None:
    if os.getpid() != _DONE.get("pid"):  # a forked worker (a pool's, a data loader's) inherited it: die as before
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
    raise Terminated()


def _terminate_as_interrupt() -> None:
    """While the command runs, SIGTERM raises Terminated (a handler of the caller's own is left alone)."""
    try:
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            _DONE["sigterm"], _DONE["pid"] = signal.signal(signal.SIGTERM, _terminated), os.getpid()
    except ValueError:  # not the main thread: Python runs signal handlers in the main thread only
        pass


def end_program(code: int) -> NoReturn:
    """End the process after its work as the interpreter would (threads joined, exit handlers run, streams flushed)
    with a Ctrl-C still held, but without the interpreter's teardown: Python puts SIGINT back to its default before
    it frees the modules (seconds with torch loaded), so a Ctrl-C then killed the process without a word (-2), and
    one during an exit handler printed its traceback. A Ctrl-C at any point of it: the one line, 130."""
    import atexit
    import threading

    if threading.current_thread() is threading.main_thread() and hasattr(threading, "_shutdown"):
        threading._shutdown()  # what the interpreter does first at exit: wait for non-daemon threads
    atexit._run_exitfuncs()
    if _DONE.get("interrupted"):
        _exit_interrupted()
    _flush()
    os._exit(code)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach the reader
            pass


# Config keys whose values are the user's text, never config syntax: `${...}` in them stays as typed.
DATA_KEYS = ("prompt", "data.system_prompt", "data.chat_template")


def literal_data(override: str) -> str:
    """`prompt=${oc.env:HOME}` -> `prompt=\\${oc.env:HOME}`: OmegaConf's escape, so a prompt or data string is
    data (the text as typed), never an interpolation resolved (or failing) when the config is read."""
    key, eq, value = override.partition("=")
    if not eq or key.lstrip("+~") not in DATA_KEYS:
        return override
    out, i = [], 0
    while i < len(value):
        if value.startswith("\\${", i):  # already escaped: keep as typed
            out.append(value[i:i + 3])
            i += 3
        elif value.startswith("${", i):
            out.append("\\${")
            i += 2
        else:
            out.append(value[i])
            i += 1
    return f"{key}={''.join(out)}"


def config_path(output: str | Path) -> Path:
    """Where an output file's config goes: `<output without its suffix>.config.yaml`."""
    return Path(output).with_suffix(".config.yaml")


def save_config(cfg, path: str | Path, overwrite: bool = False) -> Path:
    """Write the composed config as YAML to `path` (atomically; temp files of a killed earlier write are removed),
    so an output says how it was made: `<output_dir>/config.yaml`, or `<file>.config.yaml` beside an output file.
    Only over a config selfspec wrote, or with overwrite=true (core/ownership.py): check_output(path, ...,
    config_kind(cfg)) with the entry point's other checks, so a refusal comes before the work (owned_output does both
    for an output file). Call it after the entry point's checks (a refused run must not leave a config behind), by
    the output's one writer (rank 0)."""
    from omegaconf import OmegaConf

    from selfspec.core.ownership import CONFIG_HEADER, config_kind, owned_path

    with owned_path(path, "config file", config_kind(cfg), overwrite) as tmp:
        tmp.write_text(CONFIG_HEADER + OmegaConf.to_yaml(cfg), encoding="utf-8")
    return Path(path)


@contextlib.contextmanager
def owned_output(cfg, path, what: str, kind, inputs=(), also=()) -> Iterator[Optional[Path]]:
    """An entry point's output file, from the checks before its work to its config after, in one routine:

        with owned_output(cfg, cfg.output_file, "output_file", REPORT, inputs(cfg)) as tmp:
            report = ...the work...
            tmp.write_text(json.dumps(report))

    Before the body, `path`, the config beside it (`<what>'s config`, config_path) and the `also` files written after
    it (plots, as (path, what, Kind)) are each checked (core/ownership.check_output, `cfg.overwrite`), so a refusal
    costs nothing and touches nothing. The body runs under `path`'s writer lock and fills a temp path beside it (also
    streamed into during the work, as generate's rows); when it ends, the temp file replaces `path` atomically and
    the config the command ran with (`cfg` as it is then) is saved beside it. An error in the body leaves both as they
    were. `path` None: the command writes no file; the body gets None and nothing is checked or written."""
    from selfspec.core.ownership import check_output, config_kind, owned_path

    if path is None:
        yield None
        return
    beside = config_path(path)
    for p, w, k in [(path, what, kind), (beside, f"{what}'s config", config_kind(cfg)), *also]:
        check_output(p, w, k, cfg.overwrite, inputs)
    with owned_path(path, what, kind, cfg.overwrite, inputs) as tmp:
        yield tmp
    save_config(cfg, beside, cfg.overwrite)


# ---------------------------------------------------------------------------------------------- --help

GRAMMAR = """\
Overrides use Hydra's grammar: key=value sets a field (train.lr=1e-3, data.path=chats.jsonl), group=option puts
a config file of <group>/ in place (target=tiny-llama), +key=value adds a key under a free-form node
(+heads.NAME=..., +target.tiny.KEY=...), ~key removes one; lists are [a,b], null is None; quote values with
spaces (prompt="Hello there"). --cfg prints the composed config and exits."""


def help_text(config_name: str, overrides: list[str], prog: str, doc: str | None = None, schema: type | None = None,
              groups: dict[str, dict[str, type]] | None = None) -> str:
    """Usage, the module's summary, the override grammar, the groups and every field of the config composed with
    `overrides` (type, value, help), grouped by config node. If the overrides do not compose, the fields of
    `schema` and of the `groups` options' schemas, with their defaults."""
    from omegaconf import OmegaConf, open_dict

    lines = [f"usage: {prog} [key=value ...] [group=option ...] [--cfg] [-h]", ""]
    if doc and doc.strip():
        lines += [" ".join(doc.strip().split("\n\n")[0].split()), ""]
    home = primary_dir(config_name)
    primary = f"{home / config_name}.yaml; " if home else ""  # or a schema alone
    lines += [GRAMMAR, "", f"Config files: {primary}the groups' folders in {CONF_DIR} and {METHODS_DIR}/*/conf.", ""]
    try:
        cfg = compose_config(config_name, overrides, return_hydra_config=True)
    except UserError as e:  # still show the fields, with the schemas' own defaults
        lines += [f"(these overrides do not compose: {one_line(e)}; showing the schemas' defaults)", ""]
        nodes = [("", schema)] if schema is not None else []
        nodes += [(f"{group}={name.removesuffix('_schema')}: ", node) for group, options in (groups or {}).items()
                  for name, node in options.items()]
        for title, node in nodes:
            lines += [f"{title}{node.__name__}"] + _field_lines(OmegaConf.structured(node))[2:] + [""]
        return "\n".join(lines).rstrip()
    choices = {k: v for k, v in cfg.hydra.runtime.choices.items() if not k.startswith("hydra/")}
    with open_dict(cfg):
        del cfg["hydra"]
    if choices:
        lines.append("Groups (group=option; the option in use, then the others):")
        for group, choice in reversed(choices.items()):  # Hydra lists them last-to-first
            options = sorted(p.stem for d in conf_dirs() for p in (d / group).glob("*.yaml"))
            lines.append(f"  {group}={'null' if choice is None else choice}  ({', '.join(options)})")
        lines.append("")
    lines.append("Fields, as `name (type, value with these overrides): help`, by config node:")
    return "\n".join(lines + _field_lines(cfg)[1:])


def _field_lines(node, prefix: str = "") -> list[str]:
    """One line per leaf of `node` (with its schema field's help), then a section per typed child node."""
    from omegaconf import DictConfig, OmegaConf

    schema = OmegaConf.get_type(node)
    fields = {f.name: f for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else {}
    raw = OmegaConf.to_container(node, resolve=False)
    summary = (schema.__doc__ or "").strip().split("\n")[0] if dataclasses.is_dataclass(schema) else ""
    if summary.startswith(f"{schema.__name__}("):  # the signature dataclasses writes when a class has no docstring
        summary = ""
    name = getattr(schema, "__name__", "dict")
    out, sections = ["", f"{prefix.rstrip('.') or '(top level)'}: {name}" + (f" - {summary}" if summary else "")], []
    for key in node:
        child, field = node._get_node(key), fields.get(key)
        if isinstance(child, DictConfig) and dataclasses.is_dataclass(OmegaConf.get_type(child)):
            sections.append((key, child))
            continue
        kind = field.type if field is not None else type(raw[key]).__name__
        kind = (kind if isinstance(kind, str) else getattr(kind, "__name__", str(kind))).replace("typing.", "")
        value = "required" if OmegaConf.is_missing(node, key) else f"default {_show(raw[key])}"
        text = f"{prefix}{key} ({kind}, {value})"
        help_ = field.metadata.get("help") if field is not None else None
        out.append(textwrap.fill(f"{text}: {help_}" if help_ else text, width=118, initial_indent="  ",
                                 subsequent_indent="      ", break_on_hyphens=False))
    for key, child in sections:
        out += _field_lines(child, f"{prefix}{key}.")
    return out


def _show(value: Any) -> str:
    """A value as it would be written on the command line (null, true, [a, b])."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, list):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_show(v)}" for k, v in value.items()) + "}"
    return repr(value) if value == "" else str(value)


def _prog(fn: Callable) -> str:
    """How this entry point was started: `python -m selfspec.methods.eagle.train` (also when run as __main__)."""
    module = fn.__module__
    if module == "__main__":
        module = getattr(getattr(sys.modules["__main__"], "__spec__", None), "name", None)
    return f"python -m {module}" if module else Path(sys.argv[0]).name


# What to do about the file-system errors a run can meet (errno name -> hint). They are the user's to fix: exit 2.
_OS_HINTS = {
    "ENOSPC": "free disk space or write somewhere else", "EDQUOT": "free disk space or write somewhere else",
    "EFBIG": "free disk space or write somewhere else (or raise the file size limit, ulimit -f)",
    "ENAMETOOLONG": "pick a shorter name",
    "EACCES": "pick a writable location", "EPERM": "pick a writable location", "EROFS": "pick a writable location",
    "ENOTDIR": "a file is in the way of that folder: pick another path",
    "EEXIST": "a file is in the way of that folder: pick another path",
    "ENOENT": "check the path", "EISDIR": "that path is a folder: pass a file",
}


def os_error(e: OSError) -> str:
    """One line for a file-system error: what failed, on which path, what to do."""
    where = f" ({e.filename})" if e.filename else ""
    hint = _os_hint(e) or f"rerun with {DEBUG_ENV}=1 for the traceback"
    return f"{e.strerror or type(e).__name__}{where}: {hint}" if e.strerror else f"{type(e).__name__}: {one_line(e)}"


def _os_hint(e: OSError) -> Optional[str]:
    import errno

    return _OS_HINTS.get(errno.errorcode.get(e.errno or 0, "")) if e.strerror else None


def _close_progress_bars() -> None:
    """A progress bar left open by the failure would share its line with the error, and redraw itself after it
    when the interpreter exits: close open bars first, so the error is the last line."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", None) or []):
        bar.close()


def one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 400 else text[:397] + "..."


def _config_error(e: BaseException) -> str:
    """Hydra/OmegaConf reports span several lines; keep what names the key and the fix."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    cause = e.__cause__ or getattr(e, "__context__", None)
    detail = str(cause).strip().splitlines()[0] if cause is not None and str(cause).strip() else ""
    # OmegaConf says "not in struct" for plain configs, "Key 'x' not in 'TrainConfig'" for typed (dataclass) ones
    if "not in struct" in detail or "not in struct" in first or (detail.startswith("Key '") and "' not in '" in detail):
        key = first.split("'")[1] if "'" in first else detail
        full = re.search(r"full_key: (\S+)", f"{e}\n{cause or ''}")  # a key inside a dict node: name it whole
        key = full.group(1) if full and full.group(1).startswith(f"{key}.") else key
        return (f"unknown config key '{key}' (misspelled? `--cfg` prints every valid key; `+key=value` adds one under "
                "a free-form node such as heads)")
    if "Could not find" in first and "options" in str(e):
        return " ".join(str(e).split())
    said = f"bad config: {first}" + (f": {detail}" if detail and detail not in first else "")
    typed = re.fullmatch(r"\w+: ([\w.+~]+)=(.*)", first)  # "LexerNoViableAltException: prompt=héllo"
    if "token recognition error" in said and typed:  # Hydra's grammar reads an unquoted value as ASCII syntax
        key, value = typed.groups()
        return (f"{said}; quote the value inside the override: '{key}=\"{value}\"' (the outer quotes are the "
                "shell's; a quoted value may hold any character)")
    return said


def flatten(tree: dict, prefix: str = "") -> dict:
    """A nested config as {dotted.key: leaf} (an empty dict is a leaf)."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
