"""The one exception type that entry points turn into a one-line message (and exit code 2)."""


class UserError(Exception):
    """Bad input the user can fix: the message says what is wrong and what to do, on one line."""
