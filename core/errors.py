"""The one exception type that entry points turn into a one-line message (and exit code 2), and the block that
turns a failed read of a user's file into one."""

from contextlib import contextmanager


class UserError(Exception):
    """Bad input the user can fix: the message says what is wrong and what to do, on one line."""


@contextmanager
def reading(what: str, name, fix: str = "", pickled_fix: str = ""):
    """Read a user's file inside this block: what fails turns into one line. A refused pickle (torch.load with
    weights_only) says nothing in it was run (+ `pickled_fix`); damage says 'corrupt or truncated' (+ `fix`); an
    unreadable file says why (the file may well be fine). UserError and anything else (MemoryError,
    KeyboardInterrupt...) pass through untouched."""
    import pickle

    from safetensors import SafetensorError

    try:
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
