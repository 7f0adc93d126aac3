"""Model configuration: one dataclass for every family, read from a Hugging Face `config.json`.

The decoder in `model.py` is a single class; the differences between OPT, LLaMA, GPT-NeoX and the
LLaMA-shaped Qwen2, Qwen3, Mistral and Phi-3 are the flags below (litgpt's approach). Weight-layout quirks
(NeoX's and Phi-3's fused matrices, OPT's position offset) live in `weights/hf.py`, not here.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import UserError, note


@dataclass(frozen=True)
class Config:
    family: str  # "llama" | "opt" | "gpt_neox" | "qwen2" | "qwen3" | "mistral" | "phi3" (LLaMA-shaped, own names)
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
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head's query and key, before RoPE
    windows: tuple[int | None, ...] = ()  # per layer: a sliding window W, or None (global); () = all global
    mlp_bias: bool = False
    tie_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window W (it attends to positions p > t - W), or None for a global layer."""
        return self.windows[layer] if self.windows else None

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
            hf = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError, OSError) as e:
            raise UserError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(hf, dict):
            raise UserError(f"{path} must hold a JSON object, not {type(hf).__name__}")
        kind = hf.get("model_type")
        if kind not in _READERS:
            raise UserError(f"unknown model_type {kind!r} in {path} (supported: {', '.join(_READERS)})")
        cfg = _READERS[kind](Fields(hf, path))
        cfg.check(path)
        return cfg

    def check(self, path) -> None:
        """Consistency of the numbers read (each one was type-checked where it was read)."""
        if self.n_head % self.n_kv_head:
            raise UserError(f"{path}: {self.n_head} attention heads do not split into {self.n_kv_head} KV heads")
        if self.rotary_dim % 2:
            raise UserError(f"{path}: the rotary dimension {self.rotary_dim} must be even")
        if self.rope_llama3 is not None and self.rope_llama3[2] <= self.rope_llama3[1]:
            raise UserError(f"{path}: rope_scaling needs high_freq_factor > low_freq_factor")

    def check_length(self, length: int, what: str) -> None:
        """A sequence of `length` tokens against the model's positions. Learned position embeddings (OPT) end
        at `max_seq_len`: refused. RoPE (LLaMA, NeoX) extrapolates: a one-line warning, then on."""
        if length <= self.max_seq_len:
            return
        if self.learned_pos:
            raise UserError(f"{what} needs {length} positions, but this {self.family} model has {self.max_seq_len} "
                            "(learned position embeddings end there)")
        note(f"h2o-mini: warning: {what} reaches position {length}, past the {self.max_seq_len} "
                       "positions this model was trained on (RoPE extrapolates; quality may drop)")


_REQUIRED = object()


class Fields:
    """Typed access to a config.json object: every value is checked where it is read, so a wrong type or
    a nonsensical number is a one-line UserError naming the key, never a crash later."""

    def __init__(self, hf: dict, path: Path):
        self.hf, self.path = hf, path

    def get(self, key: str, kind, default=_REQUIRED):
        value = self.hf.get(key)
        if value is None:
            if default is _REQUIRED:
                raise UserError(f"{self.path} lacks the key {key!r}")
            return default
        ok = {int: lambda v: isinstance(v, int) and not isinstance(v, bool),
              float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
              bool: lambda v: isinstance(v, bool), str: lambda v: isinstance(v, str),
              dict: lambda v: isinstance(v, dict)}[kind]
        if not ok(value):
            expected = "a finite number" if kind is float else kind.__name__
            raise UserError(f"{self.path}: {key!r} is {value!r}, expected {expected}")
        return float(value) if kind is float else value

    def count(self, key: str, default=_REQUIRED, low: int = 1) -> int:
        """A positive integer (a size, a count of heads or layers)."""
        value = self.get(key, int, default)
        if value < low or value > 2**31:
            raise UserError(f"{self.path}: {key!r} is {value}, expected an integer in [{low}, 2**31]")
        return value

    def positive(self, key: str, default=_REQUIRED) -> float:
        value = self.get(key, float, default)
        if value <= 0:
            raise UserError(f"{self.path}: {key!r} is {value}, expected a positive number")
        return value

    def token_ids(self, key: str) -> tuple[int, ...]:
        value = self.hf.get(key)
        values = value if isinstance(value, list) else ([] if value is None else [value])
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
            raise UserError(f"{self.path}: {key!r} is {value!r}, expected a token id or a list of them")
        return tuple(values)

    def token_id(self, key: str) -> int | None:
        ids = self.token_ids(key)
        return ids[0] if ids else None


def _rope(f: Fields) -> dict:
    """RoPE settings from either the transformers 4 keys (rope_theta, rope_scaling, rotary_pct) or the
    transformers 5 `rope_parameters` dict."""
    old, new = f.get("rope_scaling", dict, {}), f.get("rope_parameters", dict, {})
    params = {**old, **new}
    p = Fields(params, f"{f.path} (rope parameters)")
    theta = p.positive("rope_theta", f.positive("rope_theta", f.positive("rotary_emb_base", 10000.0)))
    # a scaling named by either style counts (a checkpoint may carry both, one of them "default")
    kinds = {d.get("rope_type", d.get("type")) for d in (old, new)} - {None, "default"}
    if len(kinds) > 1:
        raise UserError(f"{f.path}: rope_scaling and rope_parameters name different rope types {sorted(kinds)}")
    kind = kinds.pop() if kinds else "default"
    llama3 = None
    if kind == "llama3":
        llama3 = (p.positive("factor"), p.positive("low_freq_factor"), p.positive("high_freq_factor"),
                  p.count("original_max_position_embeddings"))
    elif kind not in ("default", None):
        raise UserError(f"unsupported rope type {kind!r} (supported: default, llama3)")
    share = p.positive("partial_rotary_factor", f.positive("rotary_pct", f.positive("partial_rotary_factor", 1.0)))
    if share > 1:
        raise UserError(f"{f.path}: the rotary share {share} must be in (0, 1]")
    return {"rope_theta": theta, "rope_llama3": llama3, "share": share}


def _head_dim(f: Fields, d: int, n_head: int, key: str | None = None) -> int:
    if key and f.hf.get(key):
        return f.count(key)
    if d % n_head:
        raise UserError(f"{f.path}: hidden_size {d} is not a multiple of num_attention_heads {n_head}")
    return d // n_head


def _windows(f: Fields, n_layer: int) -> tuple[int | None, ...]:
    """Each layer's sliding window (docs/spec.md, "Sliding-window layers"), from transformers 5's `layer_types`
    or the older keys: `sliding_window` on every layer (Mistral v0.1, Phi-3), or, for Qwen2/3 with
    `use_sliding_window`, on the layers from `max_window_layers` on. () when no layer has one; a window at
    least as long as the model's positions is no window."""
    window = f.get("sliding_window", int, None)
    if f.hf.get("use_sliding_window") is False or window is None or window >= f.hf.get("max_position_embeddings", 2**31):
        return ()
    if window < 1:
        raise UserError(f"{f.path}: 'sliding_window' is {window}, expected a positive window")
    types = f.hf.get("layer_types")
    if types is not None:
        if not (isinstance(types, list) and len(types) == n_layer
                and set(types) <= {"sliding_attention", "full_attention"}):
            raise UserError(f"{f.path}: 'layer_types' must list sliding_attention or full_attention for each of the "
                            f"{n_layer} layers")
        sliding = [t == "sliding_attention" for t in types]
    elif f.hf.get("use_sliding_window"):
        first = f.count("max_window_layers", 0, low=0)
        sliding = [i >= first for i in range(n_layer)]
    else:
        sliding = [True] * n_layer
    return tuple(window if s else None for s in sliding) if any(sliding) else ()


def _llama(f: Fields, family: str = "llama", attn_bias: bool | None = None, out_bias: bool | None = None,
           qk_norm: bool = False) -> Config:
    """LLaMA and the families that are LLaMA with a difference (`_READERS`)."""
    n_head, d = f.count("num_attention_heads"), f.count("hidden_size")
    head_dim = _head_dim(f, d, n_head, "head_dim")
    rope = _rope(f)
    bias = f.get("attention_bias", bool, False)
    attn_bias, out_bias = bias if attn_bias is None else attn_bias, bias if out_bias is None else out_bias
    return Config(
        family=family, vocab_size=f.count("vocab_size"), n_layer=f.count("num_hidden_layers"), n_head=n_head,
        n_kv_head=f.count("num_key_value_heads", n_head), d_model=d, head_dim=head_dim,
        d_ff=f.count("intermediate_size"), max_seq_len=f.count("max_position_embeddings", 2048),
        norm="rms", norm_eps=f.positive("rms_norm_eps", 1e-6), act=_act(f.get("hidden_act", str, "silu")),
        gated_mlp=True, rotary_dim=int(head_dim * rope["share"]), rope_theta=rope["rope_theta"],
        rope_llama3=rope["rope_llama3"], attn_bias=attn_bias, out_bias=out_bias, qk_norm=qk_norm,
        windows=_windows(f, f.count("num_hidden_layers")) if family != "llama" else (),
        mlp_bias=f.get("mlp_bias", bool, False),
        tie_embeddings=f.get("tie_word_embeddings", bool, False), bos_token_id=f.token_id("bos_token_id"),
        eos_token_id=f.token_ids("eos_token_id"),
    )


def _opt(f: Fields) -> Config:
    d, n_head = f.count("hidden_size"), f.count("num_attention_heads")
    if not f.get("layer_norm_elementwise_affine", bool, True):
        raise UserError("OPT with layer_norm_elementwise_affine=false is not supported")
    before = f.get("do_layer_norm_before", bool, True)
    bias = f.get("enable_bias", bool, True)
    return Config(
        family="opt", vocab_size=f.count("vocab_size"), n_layer=f.count("num_hidden_layers"), n_head=n_head,
        n_kv_head=n_head, d_model=d, head_dim=_head_dim(f, d, n_head), d_ff=f.count("ffn_dim"),
        max_seq_len=f.count("max_position_embeddings"), norm="layer", norm_eps=1e-5,
        act=_act(f.get("activation_function", str, "relu")), gated_mlp=False, norm_before=before,
        final_norm=before and not f.get("_remove_final_layer_norm", bool, False), learned_pos=True,
        d_embed=f.count("word_embed_proj_dim", d), attn_bias=bias, out_bias=bias, mlp_bias=bias,
        tie_embeddings=f.get("tie_word_embeddings", bool, True), bos_token_id=f.token_id("bos_token_id"),
        eos_token_id=f.token_ids("eos_token_id"),
    )


def _neox(f: Fields) -> Config:
    n_head, d = f.count("num_attention_heads"), f.count("hidden_size")
    head_dim = _head_dim(f, d, n_head)
    rope = _rope(f)
    bias = f.get("attention_bias", bool, True)
    return Config(
        family="gpt_neox", vocab_size=f.count("vocab_size"), n_layer=f.count("num_hidden_layers"), n_head=n_head,
        n_kv_head=n_head, d_model=d, head_dim=head_dim, d_ff=f.count("intermediate_size"),
        max_seq_len=f.count("max_position_embeddings", 2048), norm="layer",
        norm_eps=f.positive("layer_norm_eps", 1e-5), act=_act(f.get("hidden_act", str, "gelu")), gated_mlp=False,
        parallel_residual=f.get("use_parallel_residual", bool, True), rotary_dim=int(head_dim * rope["share"]),
        rope_theta=rope["rope_theta"], attn_bias=bias, out_bias=bias, mlp_bias=True,
        tie_embeddings=f.get("tie_word_embeddings", bool, False), bos_token_id=f.token_id("bos_token_id"),
        eos_token_id=f.token_ids("eos_token_id"),
    )


def _act(name: str) -> str:
    acts = {"silu": "silu", "swish": "silu", "relu": "relu", "gelu": "gelu", "gelu_new": "gelu_tanh",
            "gelu_fast": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
    if name not in acts:
        raise UserError(f"unsupported activation {name!r}")
    return acts[name]


_READERS = {
    "llama": _llama, "opt": _opt, "gpt_neox": _neox,
    "qwen2": lambda f: _llama(f, "qwen2", attn_bias=True, out_bias=False),  # biases on q, k, v only
    "qwen3": lambda f: _llama(f, "qwen3", qk_norm=True),  # per-head q/k RMSNorm; head_dim given explicitly
    "mistral": lambda f: _llama(f, "mistral"),  # LLaMA, with a sliding window on every layer in v0.1
    "phi3": lambda f: _llama(f, "phi3"),  # fused qkv_proj and gate_up_proj, split in weights/hf.py
}


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
