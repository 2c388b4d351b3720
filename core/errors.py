"""The one exception type that entry points turn into a one-line message (and exit code 2), and the block that
turns a failed read of a user's file into one; `first_line`, the one-line reason of a failed run's output."""

import re
from contextlib import contextmanager


class UserError(Exception):
    """Bad input the user can fix: the message says what is wrong and what to do, on one line."""


@contextmanager
def quiet_pickle_warnings():
    """torch.load(weights_only=True) of a file written by pickle.dump warns about its protocol on stderr before it
    refuses or reads it: two lines of torch's above the one line that says what was refused."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected pickle protocol")
        yield


@contextmanager
def reading(what: str, name, fix: str = "", pickled_fix: str = ""):
    """Read a user's file inside this block: what fails turns into one line. A refused pickle (torch.load with
    weights_only) says nothing in it was run (+ `pickled_fix`); damage says 'corrupt or truncated' (+ `fix`); an
    unreadable file says why (the file may well be fine). UserError and anything else (MemoryError,
    KeyboardInterrupt...) pass through untouched."""
    import pickle

    from safetensors import SafetensorError

    try:
        with quiet_pickle_warnings():
            yield
    except UserError:
        raise
    except pickle.UnpicklingError as e:  # weights_only refuses code and objects other than tensors
        raise UserError(f"'{name}' holds pickled objects other than tensors (code, classes) or is no torch file: "
                        f"refused, nothing in it was run{pickled_fix}") from e
    except PermissionError as e:
        raise UserError(f"cannot read {what} '{e.filename or name}': permission denied; fix its permissions or copy "
                        "it somewhere you can read") from e
    except (SafetensorError, ValueError, RuntimeError, EOFError) as e:  # ValueError: bad JSON/UTF-8 too
        raise UserError(f"{what} '{name}' is corrupt or truncated ({type(e).__name__}){fix}") from e
    except OSError as e:  # I/O error, a path that vanished
        raise UserError(f"cannot read {what} '{e.filename or name}': {e.strerror or type(e).__name__}") from e


SEED_MAX = 2**32 - 1  # numpy's seeds (transformers.set_seed) are 32-bit; batching multiplies torch's by 1_000_003


def check_range(key: str, value, low=None, high=None, low_open: bool = False, high_open: bool = False,
                integer: bool = False) -> None:
    """A config value is a finite number (an integer if asked) within its range, or a one-line UserError naming the
    key and the range: NaN passes every `<` test, so `not x >= 0` style checks alone let it through."""
    import math

    ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
          and (isinstance(value, int) or not integer)
          and (low is None or (value > low if low_open else value >= low))
          and (high is None or (value < high if high_open else value <= high)))
    if ok:
        return
    lo, hi = ("<" if low_open else "<="), ("<" if high_open else "<=")
    if low is not None and high is not None:
        cond = f"{low} {lo} {key} {hi} {high}"
    elif low is not None:
        cond = f"{key} {'>' if low_open else '>='} {low}"
    else:
        cond = f"{key} {hi} {high}"
    raise UserError(f"need {cond} (a finite {'integer' if integer else 'number'}), got {value!r}")


def first_line(text: str, limit: int = 240) -> str:
    """The reason of a failure in one line: the last 'error:' / exception line of an output, else its last line."""
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    if not lines:
        return "no output"
    pick = next((ln for ln in reversed(lines) if re.match(r"(error: |\w+(Error|Exception)\b)", ln)), lines[-1])
    pick = re.sub(r"\s+", " ", pick.removeprefix("error: "))
    return pick if len(pick) <= limit else pick[: limit - 3] + "..."
