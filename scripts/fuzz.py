"""Fuzz the engine's losslessness, from a checkout:

    python scripts/fuzz.py cases=10000 seed=1 [families=[llama,gemma3]] [drafters=[eagle,ngram]]

The harness is tests/harness/fuzz.py (its docstring says what it checks); an installed package has no tests/.
"""

from functools import partial

from selfspec.scripts._harness import run

main = partial(run, "fuzz")  # main(argv=None)

if __name__ == "__main__":
    main()
