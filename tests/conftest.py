"""Shared fixtures: tiny random checkpoints built with transformers (the oracle) and saved as safetensors,
and real English text (GPL-3) as bytes, which is what the tiny models' 256-token vocabulary reads."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

GPL3 = Path("/usr/share/common-licenses/GPL-3")
VOCAB = 256
# scripts/gpu/run.sh runs the parity tests on a GPU: every tensor a test makes lands there, models are loaded there
TEST_DEVICE = os.environ.get("H2O_MINI_TEST_DEVICE", "cpu")
if TEST_DEVICE != "cpu":  # (a default-device mode costs every op a little, so only when asked)
    torch.set_default_device(TEST_DEVICE)
# Under pytest-xdist (the README's `-n 2`) the workers share the cores: each takes its share of the threads, and
# so do the commands the tests start, instead of every process spinning one thread per core.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _threads = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    torch.set_num_threads(_threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))


def text_bytes(n: int, offset: int = 0) -> list[int]:
    """n tokens of real English: the bytes of the GPL-3 text."""
    return list(GPL3.read_bytes()[offset:offset + n])


def _llama(**kw):
    from transformers import LlamaConfig
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, max_position_embeddings=512, initializer_range=0.15, rms_norm_eps=1e-5)
    return LlamaConfig(**{**base, **kw})


def _opt(**kw):
    from transformers import OPTConfig
    base = dict(vocab_size=VOCAB, hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=512, init_std=0.15, word_embed_proj_dim=64, pad_token_id=1,
                bos_token_id=2, eos_token_id=2, dropout=0.0)
    return OPTConfig(**{**base, **kw})


def _neox(**kw):
    from transformers import GPTNeoXConfig
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=512, initializer_range=0.15)
    return GPTNeoXConfig(**{**base, **kw})


def _family(config_name: str, **kw):
    """A LLaMA-shaped family's tiny config (Qwen2, Qwen3, Mistral, Phi-3)."""
    import transformers
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)
    return getattr(transformers, config_name)(**{**base, **kw})


def _gemma(config_name: str, **kw):
    """Gemma 2 / Gemma 3 text: head_dim 32 != 64 / 4, its own attention scalar, windows of 5 (a global layer
    every third), transformers 5's config keys (layer_types, rope_parameters per layer type)."""
    import transformers
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6,
                query_pre_attn_scalar=24, sliding_window=5, pad_token_id=0,
                layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    return getattr(transformers, config_name)(**{**base, **kw})


# name -> config factory; the parity tests cover every entry
TINY = {
    "llama_mha": lambda: _llama(),
    "llama_gqa_tied": lambda: _llama(num_key_value_heads=2, tie_word_embeddings=True, attention_bias=True),
    # Llama 3.2 1B/3B's shape: tied embeddings, Llama 3 rope scaling, GQA
    "llama3_rope_scaling": lambda: _llama(num_key_value_heads=1, tie_word_embeddings=True, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}),
    "opt_pre_ln_proj": lambda: _opt(word_embed_proj_dim=32),
    "opt_post_ln_350m_style": lambda: _opt(do_layer_norm_before=False, word_embed_proj_dim=32),
    "neox_parallel": lambda: _neox(rotary_pct=0.25, use_parallel_residual=True),
    "neox_sequential": lambda: _neox(rotary_pct=0.5, use_parallel_residual=False),
    "qwen2_bias": lambda: _family("Qwen2Config", use_sliding_window=False, tie_word_embeddings=True),
    # head_dim 24 != 64 / 4, one KV head: the per-head q/k norms see 24 channels
    "qwen3_qknorm": lambda: _family("Qwen3Config", head_dim=24, num_key_value_heads=1, use_sliding_window=False),
    "mistral_no_window": lambda: _family("MistralConfig", sliding_window=None),
    "phi3_partial_rotary": lambda: _family("Phi3Config", partial_rotary_factor=0.5, sliding_window=None,
                                           pad_token_id=0),
    # sliding windows shorter than the test texts: on every layer, and hybrid (a global layer every third)
    "mistral_window": lambda: _family("MistralConfig", sliding_window=5),
    "qwen2_hybrid": lambda: _family("Qwen2Config", use_sliding_window=True, sliding_window=5, num_hidden_layers=3,
                                    layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
    # soft-caps small enough to bite (tanh far from the identity at these logits), as Gemma 2 ships 50 / 30
    "gemma2_softcap": lambda: _gemma("Gemma2Config", attn_logit_softcapping=2.0, final_logit_softcapping=5.0,
                                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # one KV head; the sliding layers rotate with base 10k, the global one with 1M and linear scaling (x8)
    "gemma3_hybrid": lambda: _gemma("Gemma3TextConfig", num_key_value_heads=1, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}),
}
# Families h2o-mini's decoder does not implement, run only inside transformers (tests/test_transformers_cache.py):
# OLMo 2 (a q/k norm over all heads' channels, norms after each branch) and StarCoder 2 (LayerNorm, biases, a
# window of 16 on every layer, wider than the budget of the tests), and BLOOM (ALiBi, attention in its own code: the cache refuses it).
OUTSIDE = {
    "olmo2": lambda: _family("Olmo2Config", bos_token_id=1, eos_token_id=2, pad_token_id=0),
    "starcoder2_window": lambda: _family("Starcoder2Config", sliding_window=16, use_bias=True, bos_token_id=1,
                                         eos_token_id=2),
    "bloom": lambda: __import__("transformers").BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4),
}
# For the (slower) eviction parity tests: OPT, LLaMA with GQA, NeoX, Qwen3 (per-head q/k norm, head_dim
# not d_model / n_head, one KV head), a hybrid model (window 5 on two layers of three), and Gemma 2 (soft-capped
# attention logits, the scores' source) and Gemma 3 (hybrid, one KV head, two RoPE bases).
FAMILIES = ["opt_pre_ln_proj", "llama_gqa_tied", "neox_parallel", "qwen3_qknorm", "qwen2_hybrid", "gemma2_softcap",
            "gemma3_hybrid"]


def seeded_weights_(model: torch.nn.Module, seed: int, std: float = 0.15) -> None:
    """Overwrite every parameter from a seeded CPU generator, in name order, so the tiny models are the same
    on every machine whatever transformers' initialisation scheme of the day: matrices and embeddings
    N(0, std^2); norm scales 1 + N(0, 0.1^2) (random enough that a wrong norm formula shows); biases
    N(0, 0.1^2). transformers' own init is never read (its scheme changed between releases)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if p.ndim >= 2:
                p.copy_(noise * std)
            elif name.endswith("bias"):
                p.copy_(noise * 0.1)
            else:  # a norm's scale
                p.copy_(1 + noise * 0.1)


def build_hf(name: str, folder: Path):
    """A tiny random transformers model with seeded weights (`seeded_weights_`), saved as safetensors;
    returns it in eval mode."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)  # transformers initialises first; every value it draws is overwritten below
    model = AutoModelForCausalLM.from_config({**TINY, **OUTSIDE}[name](), attn_implementation="eager").eval()
    seeded_weights_(model, sum(map(ord, name)))
    model.save_pretrained(folder, safe_serialization=True)
    return model


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """name -> (folder, hf_model), built once per session; handed out with eager attention, as built (a test of the
    evicting cache switches it, and the tests after it in the same process must not depend on their order)."""
    cache = {}

    def get(name: str):
        if name not in cache:
            folder = tmp_path_factory.mktemp(name)
            cache[name] = (folder, build_hf(name, folder))
        hf = cache[name][1]
        if hf.config._attn_implementation != "eager":
            hf.set_attn_implementation("eager")
        return cache[name]
    return get


@pytest.fixture(scope="session")
def tiny_model(tiny):
    """name -> h2o-mini Transformer (fp32) loaded from the saved folder."""
    from h2o_mini.weights.hf import load_hf
    models = {}

    def get(name: str):
        if name not in models:
            models[name] = load_hf(tiny(name)[0], device=TEST_DEVICE)
        return models[name]
    return get


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the others for chr(256 + n)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    extra = iter(range(256, 512))
    return {b: chr(b if b in keep else next(extra)) for b in range(256)}


def add_byte_tokenizer(path: Path) -> Path:
    """Give a tiny checkpoint a tokenizer.json that reads bytes (256 ids), so any text works. Id = the byte's
    value, in every process (tokenizers' own `ByteLevel.alphabet()` comes in a different order each time, which
    gave the same text other ids, and the tests other numbers, from run to run)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    vocab = {c: b for b, c in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="session")
def byte_folder(tiny):
    """name -> a tiny checkpoint folder with a byte tokenizer (what the CLI tests run)."""
    return lambda name="llama_gqa_tied": add_byte_tokenizer(tiny(name)[0])


@pytest.fixture(scope="session")
def llama_bytes(byte_folder):
    """The tiny LLaMA (GQA, tied embeddings) with the byte tokenizer: what most CLI and evaluation tests run."""
    return byte_folder("llama_gqa_tied")
