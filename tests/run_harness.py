"""Run a harness of tests/harness/ from a checkout: the long campaigns of what the test suite runs in short.

    python tests/run_harness.py fuzz cases=10000 seed=1 [families=[llama,gemma3]] [drafters=[eagle,ngram]]
    python tests/run_harness.py bad_inputs [only=[g_,t_]] [workers=2] [output_file=bad_inputs.md]
    python tests/run_harness.py kill_resume kills=10 seed=0 [recipe=methods/eagle/train.py] [steps=36]
    python tests/run_harness.py fault_injection [kills=5] [seed=0] [entry_points=[train,export]]

Each harness's docstring says what it checks; `<harness> --help` lists its config fields. Run by path, this file
has tests/ on sys.path, so `harness.<name>` imports as it does under pytest. Nothing here ships in the wheel.
"""

import importlib
import sys

HARNESSES = ("fuzz", "bad_inputs", "kill_resume", "fault_injection")
USAGE = f"usage: python tests/run_harness.py {{{','.join(HARNESSES)}}} [key=value ...] [--cfg] [-h]"


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if argv[0] not in HARNESSES:
        print(f"error: unknown harness '{argv[0]}'; one of: {', '.join(HARNESSES)}", file=sys.stderr)
        return 2
    name = argv[0]
    importlib.import_module(f"harness.{name}").main(argv[1:], prog=f"python tests/run_harness.py {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
