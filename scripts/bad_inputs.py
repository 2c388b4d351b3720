"""The bad-input matrix of every entry point, from a checkout:

    python scripts/bad_inputs.py [only=[g_,t_]] [workers=2] [output_file=bad_inputs.md]

The harness is tests/harness/bad_inputs.py (its docstring says what it checks); an installed package has no tests/.
"""

from functools import partial

from selfspec.scripts._harness import run

main = partial(run, "bad_inputs")  # main(argv=None)

if __name__ == "__main__":
    main()
