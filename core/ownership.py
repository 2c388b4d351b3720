"""The one rule every writer follows: a command replaces only a file or folder it can prove it wrote itself.

Each kind of output (`Kind`) says how to recognise one selfspec wrote: a folder carries `.selfspec-owner.json`
(its kind and the entries it wrote; `owned_dir` puts it there) or the record its kind always holds (an export's
selfspec.json, a head's config.json, a features index); a file carries its own header (a GGUF's general.name, a
JSONL row's every key, a PNG's Software text, a config's keys as OmegaConf writes them). `check_output` refuses
anything else in one line (UserError, exit 2) before anything is written, and so a name longer than a file name may
be (the config beside a long output_file):

- an output that is also one of the command's inputs (the same path, inside it, or holding it): always;
- a folder holding entries its kind did not write (the user's NOTES.md, plots/): always, `overwrite=true`
  included, because replacing the folder would delete them;
- a file (or, for kinds that say so, a folder of their own) that exists and is not provably ours: unless the
  user says `overwrite=true`. Empty files and folders hold nothing to lose and are always written.

`owned_dir` / `owned_path` are atomic_dir / atomic_path with the rule applied again under a writer lock beside the
output (`.<name>.selfspec.lock`, core/atomic.lock_beside), so two commands writing one output cannot interleave:
the second is refused in one line; holding it, a write first removes the temp files killed writes of that output left
(core/atomic.clean_leftovers). A process that writes the output without that lock (a user's `>> out.jsonl`) is
caught at the end: the output's state when it was checked is compared again just before the replace, and a change
refuses the replace in one line, so what was written meanwhile stays. An output that is a symlink to an existing file
or folder is written through (core/atomic.through_link): the rule applies to where it points. Call `check_output`
early too, so a refusal costs nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

from selfspec.core.atomic import (LOCK_NAME, NAME_MAX, OLD, TMP, atomic_dir, atomic_path, clean_leftovers,
                                  lock_beside, through_link)
from selfspec.core.errors import UserError

OWNER_FILE = ".selfspec-owner.json"  # in a folder selfspec wrote: {"kind": ..., "files": [the entries it wrote]}


@dataclass(frozen=True)
class Kind:
    """One kind of output. For a folder, `mine(path)` returns the names of the entries this kind wrote there, or
    None if nothing proves the folder is one of ours (the owner file is tried first); for a file, whether its
    header or record proves it. `needs_overwrite`: even our own output is replaced only with overwrite=true."""

    name: str
    folder: bool
    mine: Callable[[Path], object] = lambda path: None
    needs_overwrite: bool = False
    marked: bool = True  # owned_dir adds OWNER_FILE (False: the folder must hold exactly its files, as a staged repo)


Inputs = Iterable[tuple[str, object]]  # (config key, path or None) of what a command reads


def check_output(path, what: str, kind: Kind, overwrite: bool = False, inputs: Inputs = ()) -> Path:
    """Refuse in one line unless `path` may be written as `kind` (the module docstring's rule); returns it."""
    if path is None or not str(path).strip():
        raise UserError(f"{what} is empty; pass {what}=<{'folder' if kind.folder else 'file'}>")
    path = Path(path).expanduser()
    refuse_inputs(path, what, inputs)
    size = len(os.fsencode(path.name))
    if size > NAME_MAX:  # e.g. the config beside a 250-character output_file: <name>.config.yaml
        raise UserError(f"{what}: a name of {size} bytes ('...{path.name[-24:]}'), more than the {NAME_MAX} a file "
                        f"name may have; pass a shorter name (in '{path.parent}')")  # facts first: one_line cuts at 400
    if not os.path.lexists(path):
        return path
    if path.is_symlink() and not path.exists():  # writing would replace the user's link, or follow it nowhere
        raise UserError(f"{what} '{path}' is a symlink to '{os.readlink(path)}', which does not exist; create what it "
                        f"points to, remove the link, or pass another {what}")
    if kind.folder:
        if not path.is_dir():
            raise UserError(f"{what} '{path}' is a file; this command writes a folder there: pass a new or empty "
                            "folder")
        entries = sorted(p.name for p in path.iterdir() if not _ours_anyway(p.name))
        if not entries:
            return path
        own = _owner_files(path, kind)
        if own is None:
            own = _safely(kind.mine, path, None)
        if own is None:
            raise UserError(f"{what} '{path}' holds other files ({_names(entries)}) that selfspec did not write; "
                            f"not replacing it, even with overwrite=true: pass a new or empty folder")
        foreign = [n for n in entries if n not in set(own) | {OWNER_FILE}]
        if foreign:
            raise UserError(f"{what} '{path}' holds other files ({_names(foreign)}) beside the {kind.name} selfspec "
                            f"wrote there, which replacing it would delete (overwrite=true included): move them away "
                            f"or pass another {what}")
    else:
        if path.is_dir():
            raise UserError(f"{what} '{path}' is a folder; pass a file path")
        if path.stat().st_size == 0 or overwrite:
            return path
        if not _safely(kind.mine, path, False):
            raise UserError(f"{what} '{path}' exists and is not a {kind.name} selfspec wrote (or was changed since); "
                            f"pass overwrite=true to replace it, or another {what}")
        if not kind.needs_overwrite:
            return path
    if kind.needs_overwrite and not overwrite:
        raise UserError(f"{what} '{path}' already holds a {kind.name}; pass overwrite=true to replace it, or another "
                        f"{what}")
    return path


@contextlib.contextmanager
def owned_dir(path, what: str, kind: Kind, overwrite: bool = False, inputs: Inputs = ()) -> Iterator[Path]:
    """atomic_dir under the rule: lock beside `path`, check again, yield the temp folder to fill; the owner file
    listing what was put there is added (unless the kind is not `marked`) before the folder is swapped in."""
    path = through_link(Path(path).expanduser())
    with lock_beside(path, what):
        check_output(path, what, kind, overwrite, inputs)
        with atomic_dir(path, check=_unchanged(path, what)) as tmp:
            yield tmp
            if kind.marked:
                files = sorted(p.name for p in tmp.iterdir())
                (tmp / OWNER_FILE).write_text(json.dumps({"kind": kind.name, "files": files}) + "\n")


@contextlib.contextmanager
def owned_path(path, what: str, kind: Kind, overwrite: bool = False, inputs: Inputs = ()) -> Iterator[Path]:
    """atomic_path under the rule: lock beside `path`, check again, yield the temp path to write."""
    path = through_link(Path(path).expanduser())
    with lock_beside(path, what):
        check_output(path, what, kind, overwrite, inputs)
        clean_leftovers(path)  # temp files of killed writes (kill -9): under the lock, no live writer owns them
        with atomic_path(path, check=_unchanged(path, what)) as tmp:
            yield tmp


def _unchanged(path: Path, what: str) -> Callable[[], None]:
    """A check for just before `path` is replaced: refuse in one line if it changed since now (the writer lock keeps
    selfspec's writers out, not a user's editor or `>>`), so what another process wrote there meanwhile stays."""
    before = _state(path)

    def check() -> None:
        if _state(path) != before:
            raise UserError(f"{what} '{path}' changed while this command ran (another process wrote to it); not "
                            f"replacing it, so what was written there stays: run again once that writer is done")
    return check


def _state(path: Path) -> Optional[tuple]:
    """What a write by another process changes: a file's inode, size and modification time; a folder's inode,
    modification time and entries (None: nothing there)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    names = sorted(os.listdir(path)) if path.is_dir() else None
    return st.st_ino, st.st_size, st.st_mtime_ns, names


def refuse_inputs(path, what: str, inputs: Inputs) -> None:
    """The output may not be an input, lie inside an input folder, or (a folder) hold an input (check_output's first
    test; alone for a work folder whose fixed-name files a command reuses, as serve_bench's work_dir)."""
    path = Path(path).expanduser()
    out = _real(path)
    for key, given in inputs:
        if given is None or not str(given).strip() or not os.path.lexists(Path(str(given)).expanduser()):
            continue
        src = _real(Path(str(given)).expanduser())
        if out == src or src in out.parents or out in src.parents:
            rel = "is" if out == src else "is inside" if src in out.parents else "holds"
            raise UserError(f"{what} '{path}' {rel} the input {key} '{given}'; writing it would destroy what this "
                            f"command reads: pass another {what}")


def _real(p: Path) -> Path:
    return Path(os.path.realpath(p))


def _owner_files(path: Path, kind: Kind) -> Optional[list[str]]:
    """The entries `path`'s owner file says `kind` wrote (None: no owner file of this kind)."""
    try:
        rec = json.loads((path / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return None
    if isinstance(rec, dict) and rec.get("kind") == kind.name and isinstance(rec.get("files"), list):
        return [str(n) for n in rec["files"]]
    return None


def _ours_anyway(name: str) -> bool:
    """Entries every selfspec writer may leave and replace: its locks and the temp files of killed writes."""
    return name == LOCK_NAME or name.endswith(LOCK_NAME) or (name.startswith(".") and (TMP in name or OLD in name))


def _names(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def proves(kind: Kind, path: Path) -> bool:
    """Whether `path` is provably a `kind` selfspec wrote (its proof, read safely)."""
    return bool(_safely(kind.mine, path, False))


def _safely(test: Callable[[Path], object], path: Path, no: object) -> object:
    """A proof that cannot be read is no proof (`no`)."""
    try:
        return test(path) or no
    except Exception:  # a foreign or damaged file: whatever its parser raises, it is not ours
        return no


# ------------------------------------------------------------------------------------- proofs for files


def json_keys(*keys: str) -> Callable[[Path], bool]:
    """A JSON file whose object holds `keys`, or a JSONL file every line of which does: a record this command writes.
    One other line (a note the user appended, another tool's row) makes the whole file not provably ours."""
    def record(text: str) -> bool:
        obj = json.loads(text)
        return isinstance(obj, dict) and all(k in obj for k in keys)

    def test(path: Path) -> bool:
        with open(path, encoding="utf-8") as f:
            if path.suffix != ".jsonl":
                return record(f.read())
            lines = (line for line in f if line.strip())
            first = next(lines, None)
            return first is not None and record(first) and all(record(line) for line in lines)
    return test


CONFIG_HEADER = "# selfspec: the config this output was made with\n"  # core/cli.save_config's first line


def config_kind(cfg) -> Kind:
    """The `<output>.config.yaml` a command writes (CONFIG_HEADER, then OmegaConf's YAML; before the header, the YAML
    alone), and the config.yaml of a training run: a YAML mapping of THIS command's top-level keys (a field or two
    added since allowed) exactly as OmegaConf writes it. So a note the user added (a comment, a key of their own)
    makes it theirs, and so does another command's config beside an output of the same name (generate's co.jsonl
    and eval_heads' co.json share co.config.yaml)."""
    def test(path: Path) -> bool:
        import yaml
        from omegaconf import OmegaConf

        text = path.read_text(encoding="utf-8").removeprefix(CONFIG_HEADER)
        obj, keys = yaml.safe_load(text), set(cfg.keys())
        if not isinstance(obj, dict) or not set(obj) <= keys or len(set(obj)) < len(keys) - 2:
            return False
        return OmegaConf.to_yaml(OmegaConf.create(obj)) == text
    return Kind("config file", folder=False, mine=test)


PNG_SOFTWARE = "selfspec"  # the Software text of every PNG selfspec writes (matplotlib savefig metadata)


def png_of_selfspec(path: Path) -> bool:
    from PIL import Image

    with Image.open(path) as im:
        return str(getattr(im, "text", {}).get("Software", "")).startswith(PNG_SOFTWARE)


PNG = Kind("plot", folder=False, mine=png_of_selfspec)


def save_png(fig, path: Path, overwrite: bool = False) -> None:
    """A matplotlib figure as a PNG, written atomically, marked as selfspec's (its Software text), and only over a
    PNG selfspec wrote unless overwrite=true (owned_path)."""
    with owned_path(path, "plot", PNG, overwrite) as tmp:
        fig.savefig(tmp, format="png", dpi=120, metadata={"Software": f"{PNG_SOFTWARE} (matplotlib)"})
