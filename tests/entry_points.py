"""Running an entry point in-process and reading what it did: its exit code, its one-line refusal, the files it
left (tests/reliability)."""

import hashlib
from pathlib import Path


def run(main, *args: str) -> int:
    """An entry point in-process: its exit code (0 when it returns)."""
    try:
        main([str(a) for a in args])
    except SystemExit as e:
        return e.code
    return 0


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def refused(capsys, *words: str) -> str:
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("error: ") and "Traceback" not in line, line
    for w in words:
        assert w.lower() in line.lower(), line
    return line
