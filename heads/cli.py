"""Entry-point plumbing shared by every script: compose the Hydra config, turn bad input into one line.

Every entry point is `@entry("<config name>", <schema dataclass>)` over a `main(cfg)`. Overrides use Hydra's
grammar (`key=value`, `group=option`, `+new=1`); `--cfg` prints the composed config and exits. Errors print
one line `error: ...` to stderr and exit 2 (user error) or 1 (bug); `SELFSPEC_DEBUG=1` re-raises with the
traceback instead. We compose with Hydra's compose API rather than `@hydra.main` because the latter prints
multi-line reports for a mistyped key.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Any, Callable

from heads.errors import UserError

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
DEBUG_ENV = "SELFSPEC_DEBUG"


def register(name: str, schema: type, groups: dict[str, dict[str, type]] | None = None) -> None:
    """Make `schema` the typed base of the primary config `name` (its YAML lists `<name>_schema` first), and
    store the schemas of group options (`groups={"draft": {"eagle_schema": EagleConfig}}`)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name=f"{name}_schema", node=schema)
    for group, nodes in (groups or {}).items():
        for node_name, node in nodes.items():
            cs.store(group=group, name=node_name, node=node)


def compose_config(name: str, overrides: list[str]):
    """Compose conf/<name>.yaml with overrides; raises UserError with a one-line reason."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
            return compose(config_name=name, overrides=overrides)
    except (HydraException, OmegaConfBaseException) as e:
        raise UserError(_config_error(e)) from e


def entry(config_name: str, schema: type | None = None, groups: dict[str, dict[str, type]] | None = None) -> Callable:
    """Decorate `main(cfg)` into a CLI entry point (see the module docstring)."""

    def decorate(fn: Callable[[Any], Any]) -> Callable[[], Any]:
        @functools.wraps(fn)
        def run(argv: list[str] | None = None):
            if schema is not None:
                register(config_name, schema, groups)
            args = list(sys.argv[1:] if argv is None else argv)
            show = "--cfg" in args
            args = [a for a in args if a != "--cfg"]
            try:
                cfg = compose_config(config_name, args)
                if show:
                    from omegaconf import OmegaConf

                    print(OmegaConf.to_yaml(cfg))
                    return None
                return fn(cfg)
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
                sys.exit(1)
            except Exception as e:  # a bug or an environment failure: still one line unless debugging
                if os.environ.get(DEBUG_ENV):
                    raise
                _close_progress_bars()
                print(f"error: {type(e).__name__}: {one_line(e)} (rerun with {DEBUG_ENV}=1 for the traceback)",
                      file=sys.stderr)
                sys.exit(1)

        return run

    return decorate


# What to do about the file-system errors a run can meet (errno name -> hint).
_OS_HINTS = {
    "ENOSPC": "free disk space or write somewhere else", "EDQUOT": "free disk space or write somewhere else",
    "EACCES": "pick a writable location", "EPERM": "pick a writable location", "EROFS": "pick a writable location",
    "ENOTDIR": "a file is in the way of that folder: pick another path",
    "EEXIST": "a file is in the way of that folder: pick another path",
    "ENOENT": "check the path", "EISDIR": "that path is a folder: pass a file",
}


def os_error(e: OSError) -> str:
    """One line for a file-system error: what failed, on which path, what to do."""
    import errno

    where = f" ({e.filename})" if e.filename else ""
    hint = _OS_HINTS.get(errno.errorcode.get(e.errno or 0, ""), f"rerun with {DEBUG_ENV}=1 for the traceback")
    return f"{e.strerror or type(e).__name__}{where}: {hint}" if e.strerror else f"{type(e).__name__}: {one_line(e)}"


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
        return f"unknown config key '{key}' (misspelled? `--cfg` prints every valid key; `+key=value` adds a new one)"
    if "Could not find" in first and "options" in str(e):
        return " ".join(str(e).split())
    return f"bad config: {first}" + (f": {detail}" if detail and detail not in first else "")
