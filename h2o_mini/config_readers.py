"""Reading a Hugging Face `config.json` into `Config`: one small function per `model_type` (`READERS`), every
value type-checked where it is read (`Fields`), and a key that changes the math but is not implemented refused
by name, never ignored. Both config styles real checkpoints carry are read: transformers 4's keys
(rope_theta, rope_scaling, sliding_window_pattern, rope_local_base_freq, ...) and transformers 5's
(rope_parameters, per layer type for Gemma; layer_types).
"""
from __future__ import annotations

import math
from pathlib import Path

from .config import Config
from .errors import UserError
from .files import read_json_object


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
        if value is not None and value <= 0:
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


_LAYER_TYPES = ("full_attention", "sliding_attention")


def _rope(f: Fields, layer_type: str = "full_attention", theta: float = 10000.0) -> dict:
    """RoPE settings from either the transformers 4 keys (rope_theta, rope_scaling, rotary_pct) or the
    transformers 5 `rope_parameters` dict, which Gemma 2/3 key by layer type. `theta`: the base when none is given."""
    old, new = f.get("rope_scaling", dict, {}), f.get("rope_parameters", dict, {})
    if set(new) & set(_LAYER_TYPES):  # {"full_attention": {...}, "sliding_attention": {...}}
        new = Fields(new, f"{f.path} (rope_parameters)").get(layer_type, dict, {})
    if layer_type != "full_attention":  # the older keys: rope_scaling is the global layers' (Gemma 3)
        old = {}
    params = {**old, **new}
    p = Fields(params, f"{f.path} (rope parameters)")
    if layer_type == "full_attention":
        theta = f.positive("rope_theta", f.positive("rotary_emb_base", theta))
    theta = p.positive("rope_theta", theta)
    # a scaling named by either style counts (a checkpoint may carry both, one of them "default")
    kinds = {d.get("rope_type", d.get("type")) for d in (old, new)} - {None, "default"}
    if len(kinds) > 1:
        raise UserError(f"{f.path}: rope_scaling and rope_parameters name different rope types {sorted(kinds)}")
    kind = kinds.pop() if kinds else "default"
    llama3, linear = None, 1.0
    if kind == "llama3":
        llama3 = (p.positive("factor"), p.positive("low_freq_factor"), p.positive("high_freq_factor"),
                  p.count("original_max_position_embeddings"))
    elif kind == "linear":
        linear = p.positive("factor")
    elif kind not in ("default", None):
        raise UserError(f"unsupported rope type {kind!r} (supported: default, linear, llama3)")
    share = p.positive("partial_rotary_factor", f.positive("rotary_pct", f.positive("partial_rotary_factor", 1.0)))
    if share > 1:
        raise UserError(f"{f.path}: the rotary share {share} must be in (0, 1]")
    return {"rope_theta": theta, "rope_llama3": llama3, "rope_linear": linear, "share": share}


def _head_dim(f: Fields, d: int, n_head: int, key: str | None = None) -> int:
    if key and f.hf.get(key):
        return f.count(key)
    if d % n_head:
        raise UserError(f"{f.path}: hidden_size {d} is not a multiple of num_attention_heads {n_head}")
    return d // n_head


def _windows(f: Fields, n_layer: int, pattern: int | None = None) -> tuple[int | None, ...]:
    """Each layer's sliding window (docs/spec.md, "Sliding-window layers"), from transformers 5's `layer_types`
    or the older keys: `sliding_window` on every layer (Mistral v0.1, Phi-3); for Qwen2/3 with
    `use_sliding_window`, on the layers from `max_window_layers` on; for Gemma, every layer but each
    `pattern`-th (Gemma 2: 2; Gemma 3: `sliding_window_pattern`, 6). () when no layer has one; a window at
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
    elif pattern is not None:
        sliding = [(i + 1) % pattern != 0 for i in range(n_layer)]
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
        rope_llama3=rope["rope_llama3"], rope_linear=rope["rope_linear"], attn_bias=attn_bias, out_bias=out_bias, qk_norm=qk_norm,
        windows=_windows(f, f.count("num_hidden_layers")) if family != "llama" else (),
        mlp_bias=f.get("mlp_bias", bool, False),
        tie_embeddings=f.get("tie_word_embeddings", bool, False), bos_token_id=f.token_id("bos_token_id"),
        eos_token_id=f.token_ids("eos_token_id"),
    )


def _gemma(f: Fields, family: str) -> Config:
    """Gemma 2 and the text decoder of Gemma 3: LLaMA's attention and gated MLP (tanh-GELU), with embeddings
    scaled by sqrt(d_model), (1 + w) RMSNorms, a norm after attention and after the MLP too, logits scaled by
    `query_pre_attn_scalar`, interleaved sliding and global layers, and (Gemma 2) tanh soft-capping, or (Gemma 3)
    per-head q/k norms and its own RoPE base on the sliding layers."""
    if f.get("use_bidirectional_attention", bool, False):
        raise UserError(f"{f.path}: use_bidirectional_attention is set (an encoder such as EmbeddingGemma, not a "
                        "causal decoder): not supported")
    n_head, d, n_layer = f.count("num_attention_heads"), f.count("hidden_size"), f.count("num_hidden_layers")
    head_dim = _head_dim(f, d, n_head, "head_dim")
    gemma3 = family == "gemma3"
    rope = _rope(f, theta=1_000_000.0 if gemma3 else 10000.0)
    local = _rope(f, "sliding_attention", f.positive("rope_local_base_freq", 10000.0)) if gemma3 else rope
    if gemma3 and (local["rope_llama3"] or local["rope_linear"] != 1.0):  # Gemma 2: one RoPE for every layer
        raise UserError(f"{f.path}: a rope scaling on Gemma 3's sliding layers is not supported")
    if local["share"] != 1.0 or rope["share"] != 1.0:
        raise UserError(f"{f.path}: a partial rotary share on Gemma is not supported")

    def cap(key: str, default: float | None) -> float | None:  # transformers' default when the key is absent
        return f.positive(key, None) if key in f.hf else default
    attn_cap = cap("attn_logit_softcapping", None if gemma3 else 50.0)
    if gemma3 and attn_cap is not None:
        raise UserError(f"{f.path}: attn_logit_softcapping is {attn_cap}, which Gemma 3 does not apply (transformers "
                        "ignores it): refused rather than guessed")
    act = f.get("hidden_activation", str, None) or f.get("hidden_act", str, "gelu_pytorch_tanh")
    bias = f.get("attention_bias", bool, False)
    return Config(
        family=family, vocab_size=f.count("vocab_size"), n_layer=n_layer, n_head=n_head,
        n_kv_head=f.count("num_key_value_heads", n_head), d_model=d, head_dim=head_dim,
        d_ff=f.count("intermediate_size"), max_seq_len=f.count("max_position_embeddings", 8192),
        norm="rms_1p", norm_eps=f.positive("rms_norm_eps", 1e-6), act=_act(act), gated_mlp=True,
        rotary_dim=head_dim, rope_theta=rope["rope_theta"], rope_linear=rope["rope_linear"], rope_llama3=rope["rope_llama3"],
        rope_theta_local=local["rope_theta"] if gemma3 else None, attn_bias=bias, out_bias=bias, qk_norm=gemma3,
        windows=_windows(f, n_layer, f.count("sliding_window_pattern", 6) if gemma3 else 2),
        embed_scale=True, sandwich_norm=True, attn_scalar=f.positive("query_pre_attn_scalar", 256.0),
        attn_softcap=attn_cap, logit_softcap=cap("final_logit_softcapping", None if gemma3 else 30.0),
        tie_embeddings=f.get("tie_word_embeddings", bool, True), bos_token_id=f.token_id("bos_token_id"),
        eos_token_id=f.token_ids("eos_token_id"),
    )


def _gemma3_multimodal(f: Fields) -> Config:
    """A Gemma 3 image-text checkpoint: its `text_config` is the decoder read here (the vision tower's tensors
    are skipped by the loader)."""
    text = f.get("text_config", dict)
    return _gemma(Fields({"eos_token_id": f.hf.get("eos_token_id"), **text}, f"{f.path} (text_config)"), "gemma3")


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


READERS = {
    "llama": _llama, "opt": _opt, "gpt_neox": _neox,
    "qwen2": lambda f: _llama(f, "qwen2", attn_bias=True, out_bias=False),  # biases on q, k, v only
    "qwen3": lambda f: _llama(f, "qwen3", qk_norm=True),  # per-head q/k RMSNorm; head_dim given explicitly
    "mistral": lambda f: _llama(f, "mistral"),  # LLaMA, with a sliding window on every layer in v0.1
    "phi3": lambda f: _llama(f, "phi3"),  # fused qkv_proj and gate_up_proj, split in weights/hf.py
    "gemma2": lambda f: _gemma(f, "gemma2"),
    "gemma3_text": lambda f: _gemma(f, "gemma3"),
    "gemma3": _gemma3_multimodal,
}


def read_config(folder: str | Path) -> Config:
    """The `Config` of the Hugging Face checkpoint in `folder`, from its config.json."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise UserError(f"no config.json in {folder}")
    hf = read_json_object(path)
    kind = hf.get("model_type")
    if kind not in READERS:
        raise UserError(f"unknown model_type {kind!r} in {path} (supported: {', '.join(READERS)})")
    cfg = READERS[kind](Fields(hf, path))
    cfg.check(path)
    return cfg
