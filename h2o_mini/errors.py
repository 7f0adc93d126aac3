"""The one exception type that the CLI turns into a one-line message and a non-zero exit, and the one way
to tell the user something on the side."""


import sys


class UserError(Exception):
    """Bad input from the user (a path, a flag, a checkpoint): reported in one line, never as a traceback."""


def note(message: str) -> None:
    """A one-line note or warning for the user, on stderr (stdout stays the command's output)."""
    print(message, file=sys.stderr, flush=True)
