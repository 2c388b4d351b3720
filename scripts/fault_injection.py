"""SIGKILL every writer at random moments, run it again, from a checkout:

    python scripts/fault_injection.py [kills=5] [seed=0] [entry_points=[train,export]]

The harness is tests/harness/fault_injection.py (its docstring says what it checks); an installed package has no tests/.
"""

from functools import partial

from selfspec.scripts._harness import run

main = partial(run, "fault_injection")  # main(argv=None)

if __name__ == "__main__":
    main()
