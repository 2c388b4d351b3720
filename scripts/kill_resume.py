"""SIGKILL a training run at random moments, resume it, from a checkout:

    python scripts/kill_resume.py kills=10 seed=0 [recipe=train/eagle.py] [steps=36]

The harness is tests/harness/kill_resume.py (its docstring says what it checks); an installed package has no tests/.
"""

from functools import partial

from selfspec.scripts._harness import run

main = partial(run, "kill_resume")  # main(argv=None)

if __name__ == "__main__":
    main()
