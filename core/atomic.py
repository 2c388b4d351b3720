"""Every write a user could lose goes through here: files and folders appear complete or not at all, and an
output folder is written by one run at a time.

- `atomic_file(path)`: a temp file beside `path`, flushed and fsynced, renamed over it, the folder fsynced.
  `write_text` / `write_bytes` / `write_json` are the one-call forms; `atomic_path(path)` yields the temp path
  for writers that take a file name (safetensors, torch.save). Finished files and folders get the mode a plain
  write would give under the user's umask (not mkstemp's or safetensors' private 0600), so shared caches, heads
  and exports stay readable by whoever could read the folder.
- `atomic_dir(folder)`: build a folder in a temp folder beside it, then swap it in. On Linux the swap is one
  `renameat2(RENAME_EXCHANGE)`, so a reader always sees the old folder or the new one; elsewhere the old one is
  renamed away first and `recover_dir` (called by the next write and by readers) puts it back if a crash hit
  the moment between the two renames. Leftovers of killed writes are removed by the next write. `keep=True` carries
  the old folder's other entries (a user's NOTES.md) into the new one (a head folder: heads/checkpoint.save_head).
  atomic_dir and atomic_path write through a symlink to an existing file or folder (`through_link`): never rename it.
- Our own names beside an output (`beside`: its temp copies, a replaced folder, its lock) never pass the file system's
  NAME_MAX, however long a legal output name is. `clean_leftovers` removes only names of that form.
- `save_tensors` / `save_torch`: safetensors' and torch's writers, whose failed writes (a full disk) they report as a
  SafetensorError or RuntimeError, with the OSError raised instead (core/cli.py: one line, exit 2).
- `output_lock(folder)`: an exclusive `flock` on `<folder>/.selfspec.lock`, held for a run's life and released by
  the kernel when the process dies (kill -9 included), so a second run on the same folder is refused in one line.
  The lock file goes when the lock is released, and so do the folders the lock itself created that hold nothing
  else by then (a refused run leaves no new empty output_dir, nor a new parent folder of an output file).
  `lock_beside(path)` is the same lock for an output replaced whole (atomic_dir / atomic_path):
  `.<name>.selfspec.lock` beside it, since the output's own inode changes with every write. `release_locks()`
  drops every lock this process holds (core/cli.py calls it when an entry point ends, however it ends).
- Which outputs a command may replace at all: core/ownership.py.
  `wait_lock(path)` is the waiting form, for work many processes may start at once but one must do (a cache).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import fcntl
import glob
import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import IO, Any, Callable, Iterator, Optional

from selfspec.core.errors import UserError

TMP, OLD = ".tmp-", ".old-"  # name parts of a write in progress and of a folder being replaced
LOCK_NAME = ".selfspec.lock"
_RENAME_EXCHANGE = 2  # linux/fs.h
NAME_MAX = 255  # bytes in one file name (ext4, xfs, btrfs, tmpfs, NFS)
_SUFFIX_ROOM = 16  # what may follow a name made by `beside`: mkstemp's 8 characters, a pid


def beside(name: str, tag: str) -> str:
    """The name of one of our own entries beside the output `name` (a temp copy: TMP, a replaced folder: OLD, a lock:
    LOCK_NAME): `.<name><tag>`; where that would not fit in NAME_MAX with what may follow it, `name` is cut and the
    first 12 hex digits of its sha256 keep it one output's own (`.<name cut>~<hex><tag>`), so a legal output name
    never makes a name of ours too long."""
    full = f".{name}{tag}"
    if len(os.fsencode(full)) + _SUFFIX_ROOM <= NAME_MAX:
        return full
    mark = "~" + hashlib.sha256(os.fsencode(name)).hexdigest()[:12]
    cut = name
    while len(os.fsencode(f".{cut}{mark}{tag}")) + _SUFFIX_ROOM > NAME_MAX:
        cut = cut[:-1]
    return f".{cut}{mark}{tag}"


def save_tensors(tensors: dict, path: str | Path, metadata: Optional[dict] = None) -> None:
    """safetensors' save_file, a failed write raised as the OSError it is (a full disk: ENOSPC, with the path) rather
    than as a SafetensorError, so core/cli.py gives it its one line and exit code."""
    import safetensors.torch
    from safetensors import SafetensorError

    try:
        safetensors.torch.save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as e:
        code = re.search(r"\(os error (\d+)\)", str(e))  # Rust's io::Error: "No space left on device (os error 28)"
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from e


class _Sink:
    """A file for torch.save that keeps the OSError of a failed write: torch reports it as a RuntimeError."""

    def __init__(self, f: IO):
        self.f, self.error = f, None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def save_torch(obj: Any, path: str | Path) -> None:
    """torch.save, a failed write raised as the OSError it is (see save_tensors)."""
    import torch

    with open(path, "wb") as f:
        sink = _Sink(f)
        try:
            torch.save(obj, sink)
        except RuntimeError:
            if sink.error is None:
                raise
            raise OSError(sink.error.errno, sink.error.strerror, str(path)) from sink.error


def with_errno(e: OSError, path: str | Path) -> OSError:
    """`e` with the errno a short write lost (numpy's tofile, which the gguf writer uses, says only '12288 requested
    and 2384 written'): the file system's answer to one more byte appended to `path` (a temp file the failed write
    leaves to be removed), else `e` as it was."""
    if e.errno is not None:
        return e
    try:
        with open(path, "ab") as f:
            f.write(b"\0")
            f.flush()
    except OSError as why:
        return OSError(why.errno, why.strerror, str(path))
    return e


def fsync_dir(folder: str | Path) -> None:
    """Make renames and new entries in `folder` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    """fsync every file in `folder` (one level) and the folder itself."""
    for p in folder.iterdir():
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(folder)


@contextlib.contextmanager
def atomic_path(path: str | Path, check: Optional[Callable[[], None]] = None) -> Iterator[Path]:
    """Yield a temp path beside `path` for any writer (safetensors, torch.save); on success it is fsynced and
    renamed over `path`, the folder fsynced; on any error the old file is untouched and the temp file removed.
    `check()` runs just before the rename and may refuse it by raising (core/ownership.py: `path` changed meanwhile).
    A symlink to an existing file is written through (through_link)."""
    path = through_link(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=beside(path.name, TMP), dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        _chmod_like(Path(tmp), path, 0o666)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        if check is not None:
            check()
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        raise named(e, path)
    fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_file(path: str | Path, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO]:
    """Write `path` through a temp file in the same folder; on any error the old file is untouched."""
    with atomic_path(path) as tmp:
        with open(tmp, mode, encoding=None if "b" in mode else encoding) as f:
            yield f


def write_text(path: str | Path, text: str) -> Path:
    with atomic_file(path) as f:
        f.write(text)
    return Path(path)


def write_bytes(path: str | Path, data: bytes) -> Path:
    with atomic_file(path, "wb") as f:
        f.write(data)
    return Path(path)


def write_json(path: str | Path, obj: Any, indent: int | None = 2) -> Path:
    return write_text(path, json.dumps(obj, indent=indent, default=str) + "\n")


@contextlib.contextmanager
def atomic_dir(folder: str | Path, keep: bool = False, check: Optional[Callable[[], None]] = None) -> Iterator[Path]:
    """Yield a temp folder to fill; on success it replaces `folder` (see the module docstring). `keep`: what the old
    folder holds under names the new one does not (a user's NOTES.md, plots/) is carried into it (carry_over), so the
    write replaces only the entries it writes. `check()` runs just before the swap and may refuse it by raising. A
    symlink to an existing folder is written through (through_link): the folder it points to is replaced."""
    folder = through_link(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    recover_dir(folder)
    clean_leftovers(folder)
    tmp = Path(tempfile.mkdtemp(prefix=beside(folder.name, TMP), dir=folder.parent))
    try:
        _chmod_like(tmp, folder, 0o777)
        yield tmp
        umask_modes(tmp, top=False)  # the folder itself already has the mode the one it replaces had
        fsync_tree(tmp)
        if keep:  # after umask_modes: a carried file is the user's own inode, its mode stays theirs
            carry_over(folder, tmp)
        if check is not None:
            check()
        swap_in(tmp, folder)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise named(e, folder)


_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a write refused for want of room


def named(e: BaseException, path: Path) -> BaseException:
    """`e`, or, for a write refused for want of room that names no file (Python's own file writes, which report
    the errno alone), the same error naming the output `path` being written."""
    if isinstance(e, OSError) and e.errno in _FULL and e.filename is None:
        return OSError(e.errno, e.strerror, str(path)).with_traceback(e.__traceback__)
    return e


def through_link(path: str | Path) -> Path:
    """Where a write of `path` goes: `path`, or, if it is a symlink to an existing file or folder, what it points to.
    Replacing the link itself would rename the user's link away and leave the folder it points to as it was; written
    through, the link stays a link and the output lands where it leads (the ownership rules apply there)."""
    path = Path(path)
    return Path(os.path.realpath(path)) if path.is_symlink() and path.exists() else path


def carry_over(old: Path, new: Path) -> None:
    """Put into the folder `new` every entry of the folder `old` whose name `new` does not hold: hard links where the
    file system allows them (the same files, no copy), else copies; symlinks as symlinks."""
    if not old.is_dir():
        return
    for entry in old.iterdir():
        dst = new / entry.name
        if os.path.lexists(dst):
            continue
        if entry.is_symlink():
            os.symlink(os.readlink(entry), dst)
        elif entry.is_dir():
            shutil.copytree(entry, dst, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(entry, dst)
    fsync_dir(new)


def _link_or_copy(src: str | Path, dst: str | Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # no hard links here (some network and FUSE file systems): a copy
        shutil.copy2(src, dst)


def swap_in(src: Path, dst: Path) -> None:
    """Put the complete folder `src` at `dst`, replacing what is there; the old folder is deleted after."""
    if not dst.exists():
        os.replace(src, dst)
    elif _exchange(src, dst):
        shutil.rmtree(src, ignore_errors=True)  # src now holds the old folder
    else:
        old = dst.with_name(f"{beside(dst.name, OLD)}{os.getpid()}")
        os.replace(dst, old)
        os.replace(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    fsync_dir(dst.parent)


def recover_dir(folder: Path) -> None:
    """If a swap died between its two renames (no `folder`, its old copy beside it), put the old copy back."""
    if folder.exists() or not folder.parent.exists():
        return
    olds = sorted(folder.parent.glob(glob.escape(beside(folder.name, OLD)) + "*"), key=lambda p: p.stat().st_mtime)
    if olds:
        os.replace(olds[-1], folder)
        fsync_dir(folder.parent)


# What follows a leftover's name (beside): mkstemp/mkdtemp's 8 characters, the pid of a swap_in.
_LEFTOVER_ENDS = ((TMP, r"[a-z0-9_]{8}"), (OLD, r"[0-9]+"))


def clean_leftovers(folder: Path) -> None:
    """Remove the temp and replaced copies of `folder` (a file or a folder) that killed writes left beside it: only
    names ours have, never `folder` itself nor a user's file that merely starts alike. Only call it while holding the
    output's writer role (output_lock, lock_beside): then no live writer owns them."""
    for tag, end in _LEFTOVER_ENDS:
        start = beside(folder.name, tag)
        for p in folder.parent.glob(glob.escape(start) + "*"):
            if re.fullmatch(end, p.name[len(start):]):
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


def umask_modes(folder: Path, top: bool = True) -> None:
    """Give a finished temp folder (`top`) and what is in it the modes a plain mkdir/open would under the user's
    umask: mkdtemp makes 0700 folders, and safetensors and torch.save write 0600 files."""
    umask = _umask()
    if top:
        os.chmod(folder, 0o777 & ~umask)
    for p in folder.rglob("*"):
        if not p.is_symlink():
            os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~umask)


def _chmod_like(tmp: Path, final: Path, default: int) -> None:
    """mkstemp/mkdtemp make private (0600/0700) entries: give `tmp` the mode `final` has, or the one a plain
    open/mkdir would give, so a shared cache or a published head stays readable by the others who could read it."""
    try:
        mode = final.stat().st_mode & 0o7777
    except OSError:
        mode = default & ~_umask()
    os.chmod(tmp, mode)


def _umask() -> int:
    try:  # Linux >= 4.7: read it without changing it (os.umask would, for a moment, in every thread)
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def _exchange(a: Path, b: Path) -> bool:
    """Linux renameat2(RENAME_EXCHANGE): swap two paths in one step. False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


class _Lock:
    def __init__(self, fd: int, path: Path, created: Optional[Path] = None):
        self.fd, self.path = fd, Path(os.path.abspath(path))
        self.created = None if created is None else Path(os.path.abspath(created))  # the outermost folder it made
        _LOCKS.append(self)

    def release(self) -> None:
        """Drop the lock and its file (unlinked while still held: a process that opened it meanwhile finds it
        unlinked after its flock and retries, see _flock); the folders the lock created that hold nothing else
        go too."""
        if self.fd < 0:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()
        remove_created(self.path.parent, self.created)
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = -1
        if self in _LOCKS:
            _LOCKS.remove(self)

    def __enter__(self) -> "_Lock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


_LOCKS: list[_Lock] = []  # this process's held locks (release_locks)


def remove_created(folder: Path, created: Optional[Path]) -> None:
    """Remove `folder` and its parents up to `created` (the outermost a lock made), deepest first, while they hold
    nothing else."""
    while created is not None and folder != created.parent and folder != folder.parent:
        try:
            folder.rmdir()  # only an empty folder: OSError otherwise, and its parents stay
        except OSError:
            break
        folder = folder.parent


def release_locks() -> None:
    """Release every lock this process holds (the end of an entry point, whichever way it ends)."""
    for lock in list(_LOCKS):
        lock.release()


atexit.register(release_locks)


def acquire_lock(folder: str | Path, what: str = "output_dir", new: bool | Path = False) -> _Lock:
    """Take `folder`'s writer lock or refuse in one line (it is held by a live process). Released by
    `.release()` or when the process exits, however it exits. `new`: the caller made the folder for this run
    (True), or the outermost of it and its parents that it made (first_missing's answer, taken before mkdir)."""
    folder = Path(folder)
    created = first_missing(folder) or (new if isinstance(new, Path) else folder if new else None)
    folder.mkdir(parents=True, exist_ok=True)
    return _flock(folder / LOCK_NAME, folder, what, created)


def lock_beside(path: str | Path, what: str = "out") -> _Lock:
    """The writer lock of an output replaced whole: `.<name>.selfspec.lock` in its folder, for the write's life."""
    path = through_link(path)  # one lock for one output, by whichever name it is written
    created = first_missing(path.parent)  # removed again on release if the write left nothing there (a refusal)
    path.parent.mkdir(parents=True, exist_ok=True)
    return _flock(path.parent / beside(path.name, LOCK_NAME), path, what, created)


def first_missing(folder: str | Path) -> Optional[Path]:
    """The outermost of `folder` and its parents that does not exist yet (what mkdir(parents=True) creates)."""
    folder = Path(os.path.abspath(folder))
    missing = None
    while not folder.exists() and folder != folder.parent:
        missing, folder = folder, folder.parent
    return missing


def _flock(path: Path, shown: Path, what: str, created: Optional[Path] = None) -> _Lock:
    """flock `path` (created if missing) or refuse in one line. The holder unlinks it when done, so a lock won on
    a file that is no longer at `path` is stale: retried on the file now there. A lock that cannot be written (a
    full disk, a read-only folder) leaves nothing: neither its file nor the folders made for it."""
    created = None if created is None else Path(os.path.abspath(created))
    try:
        fd = _flocked(path, shown, what)
    except OSError:
        remove_created(Path(os.path.abspath(path)).parent, created)
        raise
    lock = _Lock(fd, path, created)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}".encode(), 0)
    except OSError as e:
        lock.release()
        raise OSError(e.errno, e.strerror, str(path)) from e
    return lock


def _flocked(path: Path, shown: Path, what: str) -> int:
    """The fd of `path` (created if missing), flocked (see _flock)."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise UserError(f"{what} '{shown}' is in use by another selfspec run ({holder}); wait for it to finish "
                            f"or pass another {what}") from None
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)  # its holder released and unlinked it between our open and our flock
    return fd


@contextlib.contextmanager
def wait_lock(path: str | Path) -> Iterator[Path]:
    """Hold an exclusive `flock` on the file `path` (created if missing), waiting for any holder first: one
    process at a time runs the body (e.g. builds a shared cache), the others wait, then re-check. Released when
    the body ends or the process dies. Read access is enough, so a lock file another user made works too."""
    path = Path(path)
    fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield path
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def output_lock(folder: str | Path, what: str = "output_dir") -> Iterator[Path]:
    lock = acquire_lock(folder, what)
    try:
        yield Path(folder)
    finally:
        lock.release()
