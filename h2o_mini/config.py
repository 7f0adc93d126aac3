"""Model configuration: one dataclass for the three families, read from a Hugging Face `config.json`.

The decoder in `model.py` is a single class; the differences between OPT, LLaMA and GPT-NeoX are the flags
below (litgpt's approach). Weight-layout quirks (NeoX's fused QKV, OPT's position offset) live in
`weights/hf.py`, not here.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import UserError


@dataclass(frozen=True)
class Config:
    family: str  # "llama" | "opt" | "gpt_neox"
    vocab_size: int
    n_layer: int
    n_head: int  # query heads
    n_kv_head: int  # key/value heads (GQA when < n_head)
    d_model: int
    head_dim: int
    d_ff: int
    max_seq_len: int
    norm: str = "rms"  # "rms" | "layer"
    norm_eps: float = 1e-5
    act: str = "silu"  # "silu" | "relu" | "gelu" | "gelu_tanh"
    gated_mlp: bool = True  # SwiGLU: down(act(gate(x)) * up(x))
    parallel_residual: bool = False  # NeoX: x + attn(ln1(x)) + mlp(ln2(x))
    norm_before: bool = True  # False: OPT-350m's post-norm blocks
    final_norm: bool = True
    rotary_dim: int = 0  # 0: no RoPE (learned positions instead)
    rope_theta: float = 10000.0
    rope_llama3: tuple[float, float, float, int] | None = None  # factor, low, high, original context
    learned_pos: bool = False  # OPT
    d_embed: int = 0  # OPT word_embed_proj_dim; project_in/out when it differs from d_model
    attn_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    tie_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.n_head // self.n_kv_head

    @classmethod
    def from_hf(cls, folder: str | Path) -> "Config":
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise UserError(f"no config.json in {folder}")
        try:
            hf = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise UserError(f"{path} is not valid JSON: {e}") from None
        kind = hf.get("model_type")
        if kind not in _READERS:
            raise UserError(f"unknown model_type {kind!r} in {path} (supported: {', '.join(_READERS)})")
        try:
            return _READERS[kind](hf)
        except KeyError as e:
            raise UserError(f"{path} lacks the key {e.args[0]!r} that a {kind} config needs") from None


def _rope(hf: dict) -> dict:
    """RoPE settings from either the transformers 4 keys (rope_theta, rope_scaling, rotary_pct) or the
    transformers 5 `rope_parameters` dict."""
    params = dict(hf.get("rope_scaling") or {})
    params.update(hf.get("rope_parameters") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", hf.get("rotary_emb_base", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    llama3 = None
    if kind == "llama3":
        llama3 = (float(params["factor"]), float(params["low_freq_factor"]), float(params["high_freq_factor"]),
                  int(params["original_max_position_embeddings"]))
    elif kind not in ("default", None):
        raise UserError(f"unsupported rope type {kind!r} (supported: default, llama3)")
    share = params.get("partial_rotary_factor", hf.get("rotary_pct", hf.get("partial_rotary_factor", 1.0)))
    return {"rope_theta": float(theta), "rope_llama3": llama3, "share": float(share)}


def _eos(hf: dict) -> tuple[int, ...]:
    eos = hf.get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))


def _llama(hf: dict) -> Config:
    n_head = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // n_head
    rope = _rope(hf)
    return Config(
        family="llama", vocab_size=hf["vocab_size"], n_layer=hf["num_hidden_layers"], n_head=n_head,
        n_kv_head=hf.get("num_key_value_heads") or n_head, d_model=hf["hidden_size"], head_dim=head_dim,
        d_ff=hf["intermediate_size"], max_seq_len=hf.get("max_position_embeddings", 2048),
        norm="rms", norm_eps=hf.get("rms_norm_eps", 1e-6), act=_act(hf.get("hidden_act", "silu")),
        gated_mlp=True, rotary_dim=int(head_dim * rope["share"]), rope_theta=rope["rope_theta"],
        rope_llama3=rope["rope_llama3"], attn_bias=hf.get("attention_bias", False),
        out_bias=hf.get("attention_bias", False), mlp_bias=hf.get("mlp_bias", False),
        tie_embeddings=hf.get("tie_word_embeddings", False), bos_token_id=hf.get("bos_token_id"),
        eos_token_id=_eos(hf),
    )


def _opt(hf: dict) -> Config:
    d = hf["hidden_size"]
    if not hf.get("layer_norm_elementwise_affine", True):
        raise UserError("OPT with layer_norm_elementwise_affine=false is not supported")
    before = hf.get("do_layer_norm_before", True)
    bias = hf.get("enable_bias", True)
    return Config(
        family="opt", vocab_size=hf["vocab_size"], n_layer=hf["num_hidden_layers"],
        n_head=hf["num_attention_heads"], n_kv_head=hf["num_attention_heads"], d_model=d,
        head_dim=d // hf["num_attention_heads"], d_ff=hf["ffn_dim"], max_seq_len=hf["max_position_embeddings"],
        norm="layer", norm_eps=1e-5, act=_act(hf.get("activation_function", "relu")), gated_mlp=False,
        norm_before=before, final_norm=before and not hf.get("_remove_final_layer_norm", False),
        learned_pos=True, d_embed=hf.get("word_embed_proj_dim") or d, attn_bias=bias, out_bias=bias,
        mlp_bias=bias, tie_embeddings=hf.get("tie_word_embeddings", True), bos_token_id=hf.get("bos_token_id"),
        eos_token_id=_eos(hf),
    )


def _neox(hf: dict) -> Config:
    n_head = hf["num_attention_heads"]
    head_dim = hf["hidden_size"] // n_head
    rope = _rope(hf)
    bias = hf.get("attention_bias", True)
    return Config(
        family="gpt_neox", vocab_size=hf["vocab_size"], n_layer=hf["num_hidden_layers"], n_head=n_head,
        n_kv_head=n_head, d_model=hf["hidden_size"], head_dim=head_dim, d_ff=hf["intermediate_size"],
        max_seq_len=hf.get("max_position_embeddings", 2048), norm="layer", norm_eps=hf.get("layer_norm_eps", 1e-5),
        act=_act(hf.get("hidden_act", "gelu")), gated_mlp=False,
        parallel_residual=hf.get("use_parallel_residual", True), rotary_dim=int(head_dim * rope["share"]),
        rope_theta=rope["rope_theta"], attn_bias=bias, out_bias=bias, mlp_bias=True,
        tie_embeddings=hf.get("tie_word_embeddings", False), bos_token_id=hf.get("bos_token_id"),
        eos_token_id=_eos(hf),
    )


def _act(name: str) -> str:
    acts = {"silu": "silu", "swish": "silu", "relu": "relu", "gelu": "gelu", "gelu_new": "gelu_tanh",
            "gelu_fast": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
    if name not in acts:
        raise UserError(f"unsupported activation {name!r}")
    return acts[name]


_READERS = {"llama": _llama, "opt": _opt, "gpt_neox": _neox}


def rope_inv_freq(cfg: Config) -> torch.Tensor:
    """Inverse frequencies (rotary_dim / 2,), with Llama 3.1's long-context rescaling when configured."""
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.rotary_dim, 2, dtype=torch.int64).float() / cfg.rotary_dim)
    if cfg.rope_llama3 is None:
        return inv
    factor, low, high, old_ctx = cfg.rope_llama3
    wavelen = 2 * math.pi / inv
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated smoothly.
    scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, smoothed, scaled)
