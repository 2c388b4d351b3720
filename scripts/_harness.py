"""Run a test harness of tests/harness/ from a checkout: scripts/fuzz.py, bad_inputs.py, kill_resume.py and
fault_injection.py are each one call of `run`. An installed package has no tests/ folder: say so, exit 2."""

import importlib
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"


def run(name: str, argv=None):
    """tests/harness/<name>.py's main(argv) (Hydra overrides of conf/<name>.yaml; sys.argv when None)."""
    if not (TESTS / "harness" / f"{name}.py").is_file():
        print(f"error: scripts/{name}.py runs the test harness tests/harness/{name}.py; it needs a git checkout "
              "of selfspec, not an installed package", file=sys.stderr)
        sys.exit(2)
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    return importlib.import_module(f"harness.{name}").main(argv)
