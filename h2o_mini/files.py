"""Reading the user's text files and writing output files: one-line errors, atomic writes, the user's umask.

An output appears complete or not at all: it is written to a temporary file beside the target and renamed
over it. The temporary file is removed on any error or interrupt. The final file gets the permissions a
plain `open(path, "w")` would give it (0666 less the umask), not mkstemp's 0600. Missing parent folders
are not created: a typo in `--out` is an error, not a new folder tree.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from .errors import UserError


def read_text(path: str | Path, what: str = "text file") -> str:
    """A UTF-8 text file's contents (a leading byte-order mark dropped), or a one-line UserError. "-" reads
    standard input, as Unix tools do."""
    if str(path) == "-":
        try:
            data = sys.stdin.buffer.read()
        except (OSError, AttributeError, ValueError) as e:
            raise UserError(f"cannot read {what} from standard input: {e}") from None
        try:
            return data.decode("utf-8-sig")
        except UnicodeDecodeError:
            raise UserError(f"{what} on standard input is not UTF-8") from None
    path = Path(path).expanduser()
    if path.is_dir():
        raise UserError(f"{what} {path} is a folder, not a file")
    if not path.is_file():
        raise UserError(f"{what} {path} does not exist")
    try:
        return path.read_text(encoding="utf-8-sig")  # a BOM (Windows editors write one) is not text
    except UnicodeDecodeError:
        raise UserError(f"{what} {path} is not UTF-8") from None
    except OSError as e:
        raise UserError(f"cannot read {what} {path}: {e.strerror}") from None


def read_json_object(path: Path) -> dict:
    """A JSON file that must hold an object (a checkpoint's config.json, tokenizer_config.json)."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as e:
        raise UserError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise UserError(f"{path} must hold a JSON object, not {type(value).__name__}")
    return value


def read_prompts(path: str | Path) -> list[str]:
    """The prompts of a file, one a non-blank line; a file with none is a UserError."""
    prompts = [line for line in read_text(path, "prompts file").splitlines() if line.strip()]
    if not prompts:
        raise UserError(f"prompts file {path} has no prompts")
    return prompts


def umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def check_output(path: str | Path, suffixes: tuple[str, ...] = ()) -> Path:
    """An output path the user gave: its folder must exist and be writable; its extension one of `suffixes`."""
    path = Path(path)
    if suffixes and path.suffix.lower() not in suffixes:
        raise UserError(f"{path}: unknown extension {path.suffix or '(none)'!r}; use one of {', '.join(suffixes)}")
    parent = path.parent
    if not parent.is_dir():
        raise UserError(f"cannot write {path}: the folder {parent} does not exist")
    if path.is_dir():
        raise UserError(f"cannot write {path}: it is a folder")
    if not os.access(parent, os.W_OK):
        raise UserError(f"cannot write {path}: the folder {parent} is not writable")
    return path


def write_atomic(path: str | Path, write: Callable[[Path], None]) -> None:
    """Call `write(tmp)` on a temporary path beside `path`, then rename it into place."""
    path = check_output(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix)
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror}") from None
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o666 & ~umask())
        os.replace(tmp, path)
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror or e}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
