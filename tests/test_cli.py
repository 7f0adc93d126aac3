"""The command line as a user runs it: real subprocesses, tiny checkpoints, and bad input of every kind."""
import json
import math
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from .conftest import GPL3


def run(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "h2o_mini", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


def assert_one_line_error(result, *needles):
    assert result.returncode != 0
    err = result.stderr.strip()
    assert "Traceback" not in result.stderr and len(err.splitlines()) == 1, result.stderr
    for needle in needles:
        assert needle in err, err


@pytest.fixture(scope="module")
def folder(byte_folder):
    """A tiny LLaMA checkpoint with a tokenizer that reads bytes (so any text works)."""
    return byte_folder("llama_gqa_tied")


def variant(folder, tmp_path, edit):
    """A copy of the checkpoint with its tensors edited."""
    out = tmp_path / "ckpt"
    shutil.copytree(folder, out)
    tensors = load_file(out / "model.safetensors")
    edit(tensors)
    save_file(tensors, out / "model.safetensors")
    return out


def test_generate_and_eval_on_a_checkpoint(folder, tmp_path):
    r = run("generate", "--model", folder, "--max-new-tokens", 8, "--policy", "h2o", "--budget", 4, "Hello")
    assert r.returncode == 0, r.stderr
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first prompt\nsecond, longer prompt here\n")
    r = run("generate", "--model", folder, "--prompts-file", prompts, "--max-new-tokens", 4, "--policy", "local",
            "--budget", "0.5", "--prefill", "stream")
    assert r.returncode == 0 and r.stdout.count("### ") == 2, r.stderr
    r = run("eval", "ppl", "--model", folder, "--text", GPL3, "--tokens", 64, "--policy", "h2o", "--budget", "0.25",
            "--compare-full", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert {"nll", "ppl", "tokens", "policy", "capacity", "seconds", "top1_agree_full", "kl_full"} <= set(out)
    assert out["capacity"] == 16 and out["tokens"] == 64 and out["policy"] == "h2o"
    assert abs(out["ppl"] - torch.tensor(out["nll"]).exp().item()) < 1e-3 and 0 <= out["top1_agree_full"] <= 1
    full = json.loads(run("eval", "ppl", "--model", folder, "--text", GPL3, "--tokens", 64, "--json").stdout)
    assert full["capacity"] == 64 and full["nll"] != out["nll"]


def test_help_shows_examples():
    r = run("generate", "--help")
    assert r.returncode == 0 and "Examples:" in r.stdout and "--policy" in r.stdout


def test_bad_checkpoints(folder, tmp_path):
    assert_one_line_error(run("generate", "--model", tmp_path / "nope", "hi"), "does not exist")
    (tmp_path / "empty").mkdir()
    assert_one_line_error(run("generate", "--model", tmp_path / "empty", "hi"), "no config.json")
    weird = tmp_path / "weird"
    shutil.copytree(folder, weird)
    (weird / "config.json").write_text(json.dumps({"model_type": "bert"}))
    assert_one_line_error(run("generate", "--model", weird, "hi"), "unknown model_type 'bert'")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(folder / "config.json", pickled)
    (pickled / "pytorch_model.bin").write_bytes(b"not really")
    assert_one_line_error(run("generate", "--model", pickled, "hi"), "safetensors only")


@pytest.mark.parametrize("edit,needle", [
    (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), "lacks the tensor model.layers.1.mlp.up_proj.weight"),
    (lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(2)}), "unexpected tensor model.layers.0.extra"),
    (lambda t: t.update({"model.norm.weight": torch.zeros(3)}), "norm_f.weight has shape (3,), expected (64,)"),
])
def test_bad_tensors(folder, tmp_path, edit, needle):
    assert_one_line_error(run("generate", "--model", variant(folder, tmp_path, edit), "hi"), needle)


def test_truncated_safetensors(folder, tmp_path):
    out = variant(folder, tmp_path, lambda t: None)
    data = (out / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert_one_line_error(run("generate", "--model", out, "hi"), "model.safetensors")


@pytest.mark.parametrize("args,needle", [
    (["--text", "/nonexistent.txt", "--tokens", 10], "does not exist"),
    (["--text", GPL3, "--tokens", 10 ** 6], "larger than the text"),
    (["--text", GPL3, "--tokens", 10, "--policy", "h2o", "--budget", "0"], "budget"),
    (["--text", GPL3, "--tokens", 10, "--policy", "h2o", "--budget", "1.5"], "budget"),
    (["--text", GPL3, "--tokens", 10, "--policy", "h2o", "--budget", "abc"], "not a number"),
    (["--text", GPL3, "--tokens", 10, "--policy", "h2o", "--budget", "4", "--recent", "5"], "negative heavy share"),
    (["--text", GPL3, "--tokens", 10, "--policy", "nope"], "nope"),
    (["--text", GPL3, "--tokens", 10, "--dtype", "float8"], "unknown dtype"),
])
def test_bad_eval_arguments(folder, args, needle):
    assert_one_line_error(run("eval", "ppl", "--model", folder, *args), needle)


def test_bench_json_and_memory_cap(folder):
    r = run("bench", "--model", folder, "--policy", "full", "--policy", "h2o", "--budget", "0.25", "--prompt-tokens", 24,
            "--new-tokens", 8, "--no-compile", "--json")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    keys = {"policy", "budget", "capacity", "batch", "prompt_tokens", "new_tokens", "prefill_s", "decode_tok_s",
            "kv_bytes", "peak_mem_bytes"}
    assert [row["policy"] for row in rows] == ["full", "h2o"] and all(keys <= set(row) for row in rows)
    assert rows[0]["capacity"] == 32 and rows[1]["capacity"] == 8
    assert rows[1]["kv_bytes"] * 4 == rows[0]["kv_bytes"]  # a quarter of the slots, a quarter of the bytes
    per_row_full = rows[0]["kv_bytes"]
    r = run("bench", "--model", folder, "--policy", "full", "--policy", "h2o", "--budget", "0.25", "--prompt-tokens", 24,
            "--new-tokens", 8, "--no-compile", "--json", "--kv-memory", 2 * per_row_full, "--vs-hf")
    assert r.returncode == 0, r.stderr
    full, h2o = [json.loads(line) for line in r.stdout.splitlines()]
    assert (full["batch"], h2o["batch"]) == (2, 8)  # the largest batches whose caches fit the cap
    # rates come from timed decode steps: a finite number (never negative or infinite), or None
    assert isinstance(h2o["hf_decode_tok_s"], float) and math.isfinite(h2o["hf_decode_tok_s"]) and "vs_hf" in h2o
    # h2o inside transformers' own generate too (full is transformers' own cache, timed once)
    assert isinstance(h2o["hf_evicting_tok_s"], float) and "hf_evicting_tok_s" not in full
    assert_one_line_error(run("bench", "--model", folder, "--kv-memory", "lots"), "not a size")


def test_plot_kept_writes_a_png(folder, tmp_path):
    out = tmp_path / "kept.png"
    r = run("plot", "kept", "--model", folder, "--policy", "local", "--policy", "h2o", "--budget", 8, "--tokens", 40,
            "--out", out)
    assert r.returncode == 0, r.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not list(tmp_path.glob(".kept*"))
    assert_one_line_error(run("plot", "kept", "--model", folder, "--layer", 9, "--out", out), "--layer")


def test_kept_matrix_matches_the_cache(tiny_model):
    """The picture's data, recorded in one pass for both panels: local keeps exactly the last C positions at
    every step, with another policy of a larger C in the same batch."""
    from h2o_mini.api import LM
    from h2o_mini.views.plot import kept_matrices
    from h2o_mini.policies import H2O, Local
    from .conftest import text_bytes
    lm = LM(tiny_model("llama_gqa_tied"), None, None)
    kept, _ = kept_matrices(lm, text_bytes(20), [Local(recent=5), H2O(heavy=4, recent=4)], layer=1, head=1)
    for t in range(20):
        assert kept[:, t].nonzero().flatten().tolist() == list(range(max(0, t - 4), t + 1))
