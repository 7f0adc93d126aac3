"""Model configuration: one dataclass for every family, read from a Hugging Face `config.json`.

The decoder in `model.py` is a single class; the differences between OPT, LLaMA, GPT-NeoX, the LLaMA-shaped
Qwen2, Qwen3, Mistral and Phi-3, and Gemma 2 / Gemma 3 are the flags below (litgpt's approach). Weight-layout
quirks (NeoX's and Phi-3's fused matrices, OPT's position offset, a multimodal Gemma 3's vision tower) live in
`weights/hf.py`, not here; reading a config.json into it lives in `config_readers.py` (`read_config`), which
imports this module, never the reverse.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import UserError, note


@dataclass(frozen=True)
class Config:
    family: str  # "llama" | "opt" | "gpt_neox" | "qwen2" | "qwen3" | "mistral" | "phi3" | "gemma2" | "gemma3"
    vocab_size: int
    n_layer: int
    n_head: int  # query heads
    n_kv_head: int  # key/value heads (GQA when < n_head)
    d_model: int
    head_dim: int
    d_ff: int
    max_seq_len: int
    norm: str = "rms"  # "rms" | "layer" | "rms_1p" (Gemma: x_hat * (1 + weight), multiplied in fp32)
    norm_eps: float = 1e-5
    act: str = "silu"  # "silu" | "relu" | "gelu" | "gelu_tanh"
    gated_mlp: bool = True  # SwiGLU: down(act(gate(x)) * up(x))
    parallel_residual: bool = False  # NeoX: x + attn(ln1(x)) + mlp(ln2(x))
    norm_before: bool = True  # False: OPT-350m's post-norm blocks
    final_norm: bool = True
    rotary_dim: int = 0  # 0: no RoPE (learned positions instead)
    rope_theta: float = 10000.0
    rope_llama3: tuple[float, float, float, int] | None = None  # factor, low, high, original context
    rope_linear: float = 1.0  # "linear" rope scaling: positions divided by this factor (Gemma 3 4B+ global layers)
    rope_theta_local: float | None = None  # RoPE base of the sliding-window layers when it differs (Gemma 3)
    learned_pos: bool = False  # OPT
    d_embed: int = 0  # OPT word_embed_proj_dim; project_in/out when it differs from d_model
    attn_bias: bool = False
    out_bias: bool = False
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head's query and key, before RoPE
    windows: tuple[int | None, ...] = ()  # per layer: a sliding window W, or None (global); () = all global
    mlp_bias: bool = False
    embed_scale: bool = False  # Gemma: token embeddings times sqrt(d_model), that factor rounded to the model dtype
    sandwich_norm: bool = False  # Gemma: a norm after attention and after the MLP too, before each residual add
    attn_scalar: float | None = None  # Gemma: logits scaled by attn_scalar ** -0.5 (query_pre_attn_scalar), not hd's
    attn_softcap: float | None = None  # Gemma 2: attention logits -> cap * tanh(logits / cap), before the mask
    logit_softcap: float | None = None  # Gemma 2: the same on the output logits
    tie_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window W (it attends to positions p > t - W), or None for a global layer."""
        return self.windows[layer] if self.windows else None

    @property
    def attn_scale(self) -> float:
        """The factor on q . k before the softmax: 1 / sqrt(head_dim), or Gemma's 1 / sqrt(query_pre_attn_scalar)."""
        return (self.attn_scalar or self.head_dim) ** -0.5

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.n_head // self.n_kv_head

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


def rope_inv_freq(cfg: Config, local: bool = False) -> torch.Tensor:
    """Inverse frequencies (rotary_dim / 2,) of the global layers, or with `local` of the sliding layers (their own
    base, no scaling); with linear scaling or Llama 3.1's long-context rescaling when configured."""
    theta = cfg.rope_theta_local if local else cfg.rope_theta
    inv = 1.0 / theta ** (torch.arange(0, cfg.rotary_dim, 2, dtype=torch.int64).float() / cfg.rotary_dim)
    if local:
        return inv
    if cfg.rope_linear != 1.0:
        return inv / cfg.rope_linear
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


def layer_inv_freq(cfg: Config, layer: int) -> torch.Tensor | None:
    """The inverse frequencies layer `layer` rotates with (Gemma 3's sliding layers have their own base), or None
    for a model without RoPE."""
    if not cfg.rotary_dim:
        return None
    return rope_inv_freq(cfg, local=bool(cfg.rope_theta_local and cfg.window(layer)))
