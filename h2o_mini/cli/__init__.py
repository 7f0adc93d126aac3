"""The command line. `main`, the `h2o-mini` entry point, is in app.py with the group and the single commands;
each command group (eval, sweep, bench, check-policy, explore) and the shared options have a file here."""
from .app import main

__all__ = ["main"]
