"""One decoder-only Transformer for the OPT, LLaMA and GPT-NeoX families (and the LLaMA-shaped Qwen2, Qwen3
with its per-head q/k norm, Mistral and Phi-3; and Gemma 2 / Gemma 3).

The families differ only in flags of `Config` (litgpt's approach): the norm (RMSNorm / Gemma's (1 + w)
RMSNorm / LayerNorm), the MLP (SwiGLU / GeGLU / ReLU / GELU), the residual wiring (sequential / NeoX parallel /
OPT-350m post-norm / Gemma's extra norms after attention and MLP), the position scheme (RoPE on all or part of
each head, with one base for the sliding layers and one for the global ones / learned embeddings), the
attention scale and soft-capping, and the biases. Checkpoint quirks live in `weights/hf.py`.

The model never owns a KV cache: `forward` takes one (`cache.KVCache`) explicitly, plus the original
position of every token, which is what RoPE and learned positions use even after eviction. Negative
positions mark left padding. References: Vaswani et al. 2017 (attention), Su et al. 2021 (RoPE),
Touvron et al. 2023 (LLaMA), Zhang et al. 2022 (OPT), Black et al. 2022 (GPT-NeoX), Gemma Team 2024
(Gemma 2, arXiv 2408.00118) and 2025 (Gemma 3, arXiv 2503.19786).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import Config, rope_inv_freq
from .parallel import Shard, all_reduce

_ACTS = {"silu": F.silu, "relu": F.relu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, plus_one: bool = False):
        super().__init__()
        self.eps, self.plus_one = eps, plus_one
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()  # normalise in fp32 as the reference implementation does, whatever the model dtype
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.plus_one:  # Gemma: the weight is stored as an offset from 1, and the product is taken in fp32
            return (x32 * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * x32.to(x.dtype)


def make_norm(cfg: Config, dim: int | None = None) -> nn.Module:
    dim = dim or cfg.d_model
    if cfg.norm == "layer":
        return nn.LayerNorm(dim, cfg.norm_eps)
    return RMSNorm(dim, cfg.norm_eps, plus_one=cfg.norm == "rms_1p")


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma 2's soft-capping: cap * tanh(x / cap), which bounds |x| below cap (no-op for None)."""
    return x if cap is None else torch.tanh(x / cap) * cap


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first `rotary_dim` channels. x: (B, H, T, D); cos, sin: (B, 1, T, rotary_dim)."""
    rd = cos.shape[-1]
    rot, rest = x[..., :rd], x[..., rd:]
    half1, half2 = rot.chunk(2, dim=-1)
    rotated = torch.cat((-half2, half1), dim=-1)
    return torch.cat((rot * cos + rotated * sin, rest), dim=-1)


class Rope:
    """A layer's rotary embedding as a function of positions, for the rules that reason about queries at other
    positions (`Policy.observe`: Expected Attention undoes a query's rotation and averages it over the next ones)."""

    def __init__(self, inv_freq: torch.Tensor):
        self.inv_freq = inv_freq  # (rotary_dim / 2,) fp32

    def cos_sin(self, pos: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (..., rotary_dim) of the angles at `pos` (...), computed in fp32, as `apply_rope` takes them."""
        angles = pos[..., None].float() * self.inv_freq.to(pos.device)  # (..., rotary_dim / 2)
        emb = torch.cat((angles, angles), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def rotate(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x: (..., hd) rotated as a token at `pos` (broadcastable to x.shape[:-1]; a negative pos undoes it)."""
        return apply_rope(x, *self.cos_sin(pos, x.dtype))

    def average(self, x: torch.Tensor, first: torch.Tensor, n: int) -> torch.Tensor:
        """x: (..., hd) times the mean of the rotations to positions first .. first + n - 1 (first broadcastable to
        x.shape[:-1]): each channel pair turns by the mean cosine and sine of its angles (not a rotation)."""
        ahead = first[..., None].float() + torch.arange(n, device=x.device)  # (..., n)
        angles = ahead[..., None] * self.inv_freq.to(x.device)  # (..., n, rotary_dim / 2)
        cos, sin = angles.cos().mean(-2), angles.sin().mean(-2)
        return apply_rope(x, torch.cat((cos, cos), -1).to(x.dtype), torch.cat((sin, sin), -1).to(x.dtype))


class Attention(nn.Module):
    def __init__(self, cfg: Config, shard: Shard | None = None, window: int | None = None):
        super().__init__()
        self.cfg, self.shard = cfg, shard  # under tensor parallel: this rank's heads only (parallel.py)
        self.window = window  # a sliding-window layer attends to positions p > t - window (the cache knows too)
        d, hd = cfg.d_model, cfg.head_dim
        self.wq = nn.Linear(d, cfg.n_head * hd, bias=cfg.attn_bias)
        self.wk = nn.Linear(d, cfg.n_kv_head * hd, bias=cfg.attn_bias)
        self.wv = nn.Linear(d, cfg.n_kv_head * hd, bias=cfg.attn_bias)
        self.wo = nn.Linear(cfg.n_head * hd, d, bias=cfg.out_bias)
        self.q_norm = make_norm(cfg, hd) if cfg.qk_norm else None  # Qwen3, Gemma 3
        self.k_norm = make_norm(cfg, hd) if cfg.qk_norm else None

    def qkv(self, x, pos, rope):
        """The first stage: queries (B, n_head, T, hd), keys and values (B, n_kv_head, T, hd), after RoPE."""
        B, T, _ = x.shape
        cfg = self.cfg
        q = self.wq(x).view(B, T, cfg.n_head, cfg.head_dim).transpose(1, 2)  # (B, n_head, T, hd)
        k = self.wk(x).view(B, T, cfg.n_kv_head, cfg.head_dim).transpose(1, 2)  # (B, n_kv_head, T, hd)
        v = self.wv(x).view(B, T, cfg.n_kv_head, cfg.head_dim).transpose(1, 2)  # (B, n_kv_head, T, hd)
        if self.q_norm is not None:  # over each head's channels, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:  # keys are cached after RoPE at their original position: never re-rotated
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        return q, k, v

    def attend(self, q, k, v, pos, cache) -> torch.Tensor:
        """(B, n_head, T, hd): causal attention, or this layer's `cache.LayerCache`, which picks its path."""
        if cache is None:
            return causal_attention(q, k, v, pos, self.window, self.cfg.attn_scale, self.cfg.attn_softcap)
        return cache.attend(q, k, v, pos)

    def out(self, o: torch.Tensor) -> torch.Tensor:
        """The last stage: the heads' outputs (B, n_head, T, hd) through the output projection, (B, T, d)."""
        B, _, T, _ = o.shape
        return all_reduce(self.wo(o.transpose(1, 2).reshape(B, T, self.cfg.n_head * self.cfg.head_dim)), self.shard)

    def forward(self, x, pos, rope, cache) -> torch.Tensor:
        return self.out(self.attend(*self.qkv(x, pos, rope), pos, cache))


def causal_attention(q, k, v, pos, window: int | None = None, scale: float | None = None,
                     cap: float | None = None) -> torch.Tensor:
    """Plain causal attention over the whole sequence (no cache); padding (pos < 0) is never attended; with a
    sliding `window`, query t sees positions p > t - window only. scale: on q . k (None: 1 / sqrt(hd)); cap:
    Gemma 2's soft-cap on those logits, which SDPA cannot apply, so then the softmax is written out."""
    T = q.shape[2]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()  # (T, T)
    mask = causal & (pos >= 0)[:, None, None, :]  # (B, 1, T, T)
    if window is not None:
        mask = mask & ((pos[:, :, None] - pos[:, None, :]) < window)[:, None]
    mask = mask | torch.eye(T, dtype=torch.bool, device=q.device)  # padding queries see themselves: no NaN
    if cap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)  # (B, n_head, T, hd)
    logits = softcap((q @ k.transpose(-1, -2)).float() * (scale or q.shape[-1] ** -0.5), cap)  # (B, n_head, T, T)
    return logits.masked_fill(~mask, -torch.inf).softmax(-1).to(v.dtype) @ v


MLP_BLOCK = 2**21  # hidden-layer values per block of tokens (8 MB in fp32)


class MLP(nn.Module):
    def __init__(self, cfg: Config, shard: Shard | None = None):
        super().__init__()
        self.shard = shard
        self.act = _ACTS[cfg.act]
        self.gated = cfg.gated_mlp
        self.w_up = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.mlp_bias)
        self.w_down = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.mlp_bias)
        self.w_gate = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.mlp_bias) if cfg.gated_mlp else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A long prompt's hidden layer (tokens x d_ff, several copies) would be the largest transient of a
        # prefill, above the KV cache eviction saves: take the tokens a block at a time (one block in decode).
        rows = x.flatten(0, -2)  # (B * T, d)
        step = max(1, MLP_BLOCK // self.w_up.out_features)
        out = torch.cat([self._hidden(rows[s:s + step]) for s in range(0, rows.shape[0], step)])
        return all_reduce(out.view(*x.shape[:-1], -1), self.shard)

    def _hidden(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:  # SwiGLU (Shazeer, 2020)
            return self.w_down(self.act(self.w_gate(x)) * self.w_up(x))
        return self.w_down(self.act(self.w_up(x)))


class Block(nn.Module):
    def __init__(self, cfg: Config, shard: Shard | None = None, window: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.norm1, self.attn = make_norm(cfg), Attention(cfg, shard, window)
        self.norm2, self.mlp = make_norm(cfg), MLP(cfg, shard)
        # Gemma: each branch's output is normalised too, before its residual add
        self.post_attn_norm = make_norm(cfg) if cfg.sandwich_norm else None
        self.post_mlp_norm = make_norm(cfg) if cfg.sandwich_norm else None

    # A block in two stages around its attention, so that a reader may run the attention of several blocks
    # (and chunks) between them as one batch (`wavefront.py`); `forward` is the two stages with attention between.
    def qkv(self, x, pos, rope):
        """q, k, v (after RoPE) of the block's attention input: x normalised first, except in post-norm blocks."""
        post_norm = not (self.cfg.sandwich_norm or self.cfg.parallel_residual or self.cfg.norm_before)
        return self.attn.qkv(x if post_norm else self.norm1(x), pos, rope)

    def finish(self, x, o) -> torch.Tensor:
        """The block's output from its input x and its attention's heads o (B, n_head, T, hd)."""
        a = self.attn.out(o)  # (B, T, d)
        if self.cfg.sandwich_norm:  # Gemma 2/3
            h = x + self.post_attn_norm(a)
            return h + self.post_mlp_norm(self.mlp(self.norm2(h)))
        if self.cfg.parallel_residual:  # GPT-NeoX / GPT-J: both branches read the same input
            return x + a + self.mlp(self.norm2(x))
        if self.cfg.norm_before:  # LLaMA, most OPT sizes
            h = x + a
            return h + self.mlp(self.norm2(h))
        h = self.norm1(x + a)  # OPT-350m: the norm comes after each residual add
        return self.norm2(h + self.mlp(h))

    def forward(self, x, pos, rope, cache) -> torch.Tensor:
        return self.finish(x, self.attn.attend(*self.qkv(x, pos, rope), pos, cache))


class Transformer(nn.Module):
    def __init__(self, cfg: Config, shard: Shard | None = None):
        """shard: this rank's place under tensor parallelism (`parallel.py`); then `cfg` is its local slice."""
        super().__init__()
        self.cfg, self.shard = cfg, shard
        d_embed = cfg.d_embed or cfg.d_model
        self.tok_emb = nn.Embedding(cfg.vocab_size, d_embed)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.learned_pos else None
        self.proj_in = nn.Linear(d_embed, cfg.d_model, bias=False) if d_embed != cfg.d_model else None
        self.proj_out = nn.Linear(cfg.d_model, d_embed, bias=False) if d_embed != cfg.d_model else None
        self.layers = nn.ModuleList(Block(cfg, shard, cfg.window(i)) for i in range(cfg.n_layer))
        self.norm_f = make_norm(cfg) if cfg.final_norm else None
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(d_embed, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg) if cfg.rotary_dim else None, persistent=False)
        # Gemma 3: the sliding layers rotate with their own base (10k) and the global ones with theirs (1M)
        self.local_rope = bool(cfg.rope_theta_local and cfg.windows and cfg.rotary_dim)
        self.register_buffer("inv_freq_local", rope_inv_freq(cfg, local=True) if self.local_rope else None,
                             persistent=False)

    def forward(self, idx: torch.Tensor, pos: torch.Tensor, cache=None, last_only: bool = False) -> torch.Tensor:
        """idx, pos: (B, T) token ids and original positions (negative = padding). Returns fp32 logits
        (B, T, vocab), or (B, 1, vocab) for the last position only with `last_only` (a long prompt's logits
        would otherwise be the largest tensor of a generation). cache: a `cache.KVCache` (its layers pick the
        path from the input: one token per row is a decode step, more is a prompt chunk), or None (causal).
        """
        x = self.hidden(idx, pos, cache)
        return self.head(x[:, -1:] if last_only else x)

    def hidden(self, idx: torch.Tensor, pos: torch.Tensor, cache=None) -> torch.Tensor:
        """`forward` up to the head: the last layer's output (B, T, d_model). Scoring many rows at a large
        vocabulary takes the head a block at a time from here, never (B, T, vocab) at once."""
        x, ropes = self.embed(idx, pos)
        for i, layer in enumerate(self.layers):
            x = layer(x, pos, ropes[i], None if cache is None else cache.layers[i])
        return x

    def embed(self, idx: torch.Tensor, pos: torch.Tensor):
        """Token (and learned position) embeddings, and each layer's RoPE cos/sin at the original positions
        (one pair shared by all layers, or Gemma 3's two: one for the sliding layers, one for the global)."""
        x = self.tok_emb(idx)  # (B, T, d_embed)
        if self.cfg.embed_scale:  # Gemma: sqrt(d_model), rounded to the model dtype first as Gemma does
            x = x * torch.tensor(self.cfg.d_model ** 0.5, dtype=x.dtype)
        if self.proj_in is not None:
            x = self.proj_in(x)  # (B, T, d_model)
        if self.pos_emb is not None:
            x = x + self.pos_emb(pos.clamp(min=0))
        rope = local = self._rope(pos, self.inv_freq, x.dtype)
        if self.local_rope:
            local = self._rope(pos, self.inv_freq_local, x.dtype)
        return x, [local if self.cfg.window(i) else rope for i in range(self.cfg.n_layer)]

    @staticmethod
    def _rope(pos: torch.Tensor, inv_freq: torch.Tensor | None, dtype):
        if inv_freq is None:
            return None
        return Rope(inv_freq).cos_sin(pos.clamp(min=0)[:, None], dtype)  # each (B, 1, T, rotary_dim)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm_f is not None:
            x = self.norm_f(x)
        if self.proj_out is not None:
            x = self.proj_out(x)
        logits = self.lm_head(x) if self.lm_head is not None else F.linear(x, self.tok_emb.weight)
        return softcap(logits.float(), self.cfg.logit_softcap)  # (B, T, vocab)
