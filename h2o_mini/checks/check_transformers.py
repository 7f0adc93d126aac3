"""check-policy's transformers paths: the policy inside transformers' own model (`transformers_cache.py`), against
the naive reference run on h2o-mini's decoder with the same weights. Runs where transformers is installed.

Two tiny random transformers models (seeded, built here, no download): a LLaMA with GQA, and a Gemma 3 text
model with a sliding-window layer (its own attention scalar, q/k norms, two RoPE bases). Each is saved as
safetensors and read back by h2o-mini's loader, so both sides hold the same weights.
"""
from __future__ import annotations

import tempfile

import torch

from ..weights.hf import load_hf
from .naive import naive_logits

CONFIGS = {  # transformers config class, its fields
    "llama_gqa": ("LlamaConfig", dict(num_key_value_heads=2, tie_word_embeddings=True, attention_bias=True)),
    "gemma3": ("Gemma3TextConfig", dict(num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=12, sliding_window=6,
                                        layer_types=["sliding_attention", "full_attention"])),
}


def tiny_transformers(name: str):
    """(transformers model, h2o-mini's decoder of the same weights)."""
    import transformers
    from transformers.utils import logging as hf_logging
    config_class, fields = CONFIGS[name]
    cfg = getattr(transformers, config_class)(**{**dict(
        vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=256, rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=1, eos_token_id=2), **fields})
    torch.manual_seed(0)  # transformers initialises first; every value it drew is overwritten below
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    with torch.no_grad():
        for pname, p in sorted(hf.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(noise * 0.3 if p.ndim >= 2 else noise * 0.1 + (0 if pname.endswith("bias") else 1))
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # the table stays the only output
    try:
        with tempfile.TemporaryDirectory() as folder:
            hf.save_pretrained(folder, safe_serialization=True)
            ours = load_hf(folder)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return hf, ours


def check_paths(make, name: str, ids: list[int]):
    """(path, largest |logit difference| against the naive reference) inside transformers."""
    from ..transformers_cache import evicting_cache
    hf, model = tiny_transformers(name)
    T, n = len(ids), 30
    policy = make(T)
    x = torch.tensor([ids])

    def inside(plan, prefill):
        cache = evicting_cache(hf, policy, length=T, prefill=prefill)
        return torch.cat([hf(input_ids=x[:, s:e], cache=cache, use_cache=True).logits for s, e in plan], 1)[0]

    steps = [(t, t + 1) for t in range(n, T)]
    want = naive_logits(model, ids, policy)
    yield "decode step", _diff(inside([(t, t + 1) for t in range(T)], "stream"), want)
    yield "stream chunks of 7, then steps", _diff(inside([(s, min(s + 7, n)) for s in range(0, n, 7)] + steps,
                                                          "stream"), want)
    yield "dense prefill, then steps", _diff(inside([(0, n)] + steps, "dense"),
                                             naive_logits(model, ids, policy, dense_prompt=n))


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()
