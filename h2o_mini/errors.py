"""The one exception type that the CLI turns into a one-line message and a non-zero exit, and the one way
to tell the user something on the side."""


import re
import sys

# What to lower when a command runs out of memory, by its first words.
LOWER = {"bench": "--batch or --prompt-tokens (or cap the cache with --kv-memory)",
         "eval": "--tokens, --chunk, --lengths or --batch-size", "generate": "the prompts or --max-new-tokens",
         "plot": "--tokens", "explore": "--tokens"}


class UserError(Exception):
    """Bad input from the user (a path, a flag, a checkpoint): reported in one line, never as a traceback."""


def note(message: str) -> None:
    """A one-line note or warning for the user, on stderr (stdout stays the command's output)."""
    print(message, file=sys.stderr, flush=True)


def out_of_memory(exc: BaseException, command: str) -> str | None:
    """One line for an allocation that failed (torch's CPU or CUDA allocator, or Python's MemoryError), naming
    the size asked for and what to lower; None for any other error."""
    text = str(exc)
    if not (isinstance(exc, MemoryError) or "out of memory" in text.lower() or "not enough memory" in text
            or "can't allocate memory" in text):
        return None
    size = re.search(r"allocate (\d+) bytes", text)
    if size:
        asked = f" (a tensor of {int(size.group(1)) / 1e9:.2f} GB was asked for)"
    else:
        size = re.search(r"allocate ([\d.]+ [KMGT]iB)", text)
        asked = f" (a tensor of {size.group(1)} was asked for)" if size else ""
    lower = LOWER.get(command.split()[0] if command else "", "the sizes given")
    return f"out of memory{asked}: lower {lower}"
