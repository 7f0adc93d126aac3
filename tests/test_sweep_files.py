"""Sweep result files: the settings are part of the resume key, a file of another kind or an older version is
never reused, one writer at a time, and a plot refuses what it cannot draw honestly."""
import fcntl
import json

import pytest

from .conftest import GPL3
from .test_bad_input import one_line_error, run_cli


@pytest.fixture(scope="module")
def folder(byte_folder):
    return byte_folder("llama_gqa_tied")


def _sweep(capsys, monkeypatch, folder, out, *extra):
    return run_cli(capsys, monkeypatch, "eval", "sweep", "ppl", "--model", folder, "--text", GPL3, "--policy",
                   "local", "--budget", 8, "--out", out, "--json", *extra)


def test_sweep_resume_never_reuses_rows_of_other_settings(folder, tmp_path, capsys, monkeypatch):
    out = tmp_path / "s.jsonl"
    code, first, _ = _sweep(capsys, monkeypatch, folder, out, "--tokens", 24)
    assert code == 0
    code, second, err = _sweep(capsys, monkeypatch, folder, out, "--tokens", 40)
    assert code == 0 and "2 rows with other settings (tokens)" in err
    assert [json.loads(x)["tokens"] for x in second.splitlines()] == [40, 40]  # computed again, not the old rows
    code, third, err = _sweep(capsys, monkeypatch, folder, out, "--tokens", 40, "--kv-bits", 8)
    assert [json.loads(x)["kv_bits"] for x in third.splitlines()] == [8, 8] and "kv_bits" in err
    code, again, _ = _sweep(capsys, monkeypatch, folder, out, "--tokens", 24)
    assert again == first  # the same settings: reused as they were
    assert len(out.read_text().splitlines()) == 6


def test_sweep_refuses_a_file_of_another_kind(folder, tmp_path, capsys, monkeypatch):
    bench_file = tmp_path / "bench.jsonl"
    bench_file.write_text(json.dumps({"policy": "full", "budget": None, "decode_tok_s": 3.0}) + "\n")
    before = bench_file.read_bytes()
    code, _, err = _sweep(capsys, monkeypatch, folder, bench_file, "--tokens", 24)
    one_line_error((code, "", err), "not a row of an h2o-mini sweep")
    assert bench_file.read_bytes() == before
    ppl_file = tmp_path / "ppl.jsonl"
    assert _sweep(capsys, monkeypatch, folder, ppl_file, "--tokens", 24)[0] == 0
    before = ppl_file.read_bytes()
    code, _, err = run_cli(capsys, monkeypatch, "eval", "sweep", "needle", "--model", folder, "--lengths", 64,
                           "--depths", 0.5, "--policy", "local", "--budget", 8, "--out", ppl_file, "--no-chat")
    one_line_error((code, "", err), "a ppl sweep, not of this needle sweep")
    assert ppl_file.read_bytes() == before


def test_a_second_writer_is_refused(folder, tmp_path, capsys, monkeypatch):
    out = tmp_path / "s.jsonl"
    out.write_text("")
    with open(out, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a sweep running in another process
        code, _, err = _sweep(capsys, monkeypatch, folder, out, "--tokens", 24)
    one_line_error((code, "", err), "another sweep is writing")
    assert out.read_text() == ""


def test_a_sweep_file_of_an_older_version_is_not_reused(folder, tmp_path, capsys, monkeypatch):
    old = tmp_path / "old.jsonl"
    old.write_text(json.dumps({"policy": "local", "params": {"recent": 8}, "ppl": 9.0, "budget": "8"}) + "\n")
    code, _, err = _sweep(capsys, monkeypatch, folder, old, "--tokens", 24)
    one_line_error((code, "", err), "written by an older h2o-mini")


def test_a_plot_of_mixed_budget_kinds_is_refused(folder, tmp_path, capsys, monkeypatch):
    code, _, err = run_cli(capsys, monkeypatch, "eval", "sweep", "ppl", "--model", folder, "--text", GPL3,
                           "--tokens", 24, "--policy", "local", "--budget", "0.5", "--budget", 16,
                           "--plot", tmp_path / "s.png")
    one_line_error((code, "", err), "only fractions (0.1) or only token counts (64)")
