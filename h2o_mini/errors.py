"""The one exception type that the CLI turns into a one-line message and a non-zero exit."""


class UserError(Exception):
    """Bad input from the user (a path, a flag, a checkpoint): reported in one line, never as a traceback."""
