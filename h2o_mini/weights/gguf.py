"""Convert a LLaMA- or Gemma 3-architecture GGUF file into a normal Hugging Face checkpoint folder.

Used once per prepared model (SmolLM2-135M-Instruct, Gemma 3 270M; `weights/prepared.py`): the tensors are
dequantized with the `gguf` package (Q4_0/Q4_1/Q4_K/Q5_0/Q6_K/Q8_0/F32 ...) to fp32 and written as
`model.safetensors` with HF names, beside `config.json`, `tokenizer.json` and `tokenizer_config.json`. From then
on the model is an ordinary folder, loaded like any other checkpoint.

Two llama.cpp conventions are undone here: it stores LLaMA's Q and K rows permuted for its interleaved RoPE
(permuted back, so that the rotate-half RoPE of `model.py` and transformers applies), and it stores Gemma's
norm weights as 1 + w (Gemma's RMSNorm multiplies by 1 + w; HF stores w). The GGUF carries neither Gemma 3's
sliding-window pattern, its local RoPE base nor its attention scalar: those are Gemma 3's own constants (every
6th layer global, base 10k, head_dim), which is what llama.cpp and transformers assume too.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

from ..errors import UserError
from .gguf_tokenizer import write_tokenizer

_LAYER = r"blk\.(\d+)\."
_SHARED = [
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (_LAYER + r"attn_(q|k|v)\.weight", r"model.layers.\1.self_attn.\2_proj.weight"),
    (_LAYER + r"attn_output\.weight", r"model.layers.\1.self_attn.o_proj.weight"),
    (_LAYER + r"ffn_(gate|up|down)\.weight", r"model.layers.\1.mlp.\2_proj.weight"),
    (_LAYER + r"attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
]
_NAMES = {
    "llama": _SHARED + [(_LAYER + r"ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight")],
    "gemma3": _SHARED + [
        (_LAYER + r"attn_(q|k)_norm\.weight", r"model.layers.\1.self_attn.\2_norm.weight"),
        (_LAYER + r"post_attention_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
        (_LAYER + r"ffn_norm\.weight", r"model.layers.\1.pre_feedforward_layernorm.weight"),
        (_LAYER + r"post_ffw_norm\.weight", r"model.layers.\1.post_feedforward_layernorm.weight"),
    ],
}
GEMMA3_PATTERN, GEMMA3_LOCAL_BASE = 6, 10000.0  # every 6th layer global; the sliding layers' RoPE base


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: per head, rows (dim/2, 2) -> (2, dim/2)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert_gguf(gguf_path: Path, out: Path) -> None:
    import gguf

    try:
        reader = gguf.GGUFReader(str(gguf_path))
    except Exception as e:  # the gguf package raises plain ValueErrors/struct errors on bad files
        raise UserError(f"cannot read GGUF file {gguf_path}: {e}") from None
    meta = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("tokenizer.ggml.")}
    arch = meta.get("general.architecture")
    if arch not in _NAMES:
        raise UserError(f"{gguf_path}: GGUF architecture {arch!r} is not supported (only {', '.join(_NAMES)})")
    key = lambda name: meta[f"{arch}.{name}"]  # noqa: E731
    n_head, n_kv = key("attention.head_count"), key("attention.head_count_kv")
    tensors = {}
    for t in tqdm(reader.tensors, desc="dequantizing", unit="tensor", disable=None, leave=False):
        for pattern, template in _NAMES[arch]:
            if re.fullmatch(pattern, t.name):
                name = re.sub(pattern, template, t.name)
                break
        else:
            raise UserError(f"{gguf_path}: unexpected tensor {t.name}")
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        except NotImplementedError:
            raise UserError(f"{gguf_path}: tensor {t.name} is stored as {t.tensor_type.name}, which the gguf "
                            "package cannot dequantize") from None
        if arch == "llama" and ".q_proj." in name:
            w = _unpermute(w, n_head)
        elif arch == "llama" and ".k_proj." in name:
            w = _unpermute(w, n_kv)
        elif arch == "gemma3" and name.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp stored 1 + w
        tensors[name] = torch.from_numpy(np.ascontiguousarray(w))
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    tok = write_tokenizer(reader, arch, out)
    d, n_layer = key("embedding_length"), key("block_count")
    config = {
        "hidden_size": d, "intermediate_size": key("feed_forward_length"), "num_hidden_layers": n_layer,
        "num_attention_heads": n_head, "num_key_value_heads": n_kv,
        "max_position_embeddings": key("context_length"),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)), "vocab_size": tok["vocab_size"],
        "tie_word_embeddings": "lm_head.weight" not in tensors, "bos_token_id": tok["bos_id"],
        "eos_token_id": tok["eos_id"], "torch_dtype": "float32",
    }
    if arch == "llama":
        config.update(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
                      head_dim=meta.get("llama.rope.dimension_count", d // n_head))
    else:
        head_dim = key("attention.key_length")
        config.update(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", head_dim=head_dim,
                      hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=head_dim,
                      sliding_window=key("attention.sliding_window"), rope_local_base_freq=GEMMA3_LOCAL_BASE,
                      layer_types=["full_attention" if (i + 1) % GEMMA3_PATTERN == 0 else "sliding_attention"
                                   for i in range(n_layer)])
        if meta.get("gemma3.rope.scaling.type") not in (None, "none"):
            config["rope_scaling"] = {"rope_type": meta["gemma3.rope.scaling.type"],
                                      "factor": float(meta["gemma3.rope.scaling.factor"])}
    config["source"] = {"gguf": gguf_path.name, "name": meta.get("general.name"), "license": meta.get("general.license")}
    (out / "config.json").write_text(json.dumps(config, indent=2))
