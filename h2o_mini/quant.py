"""How the cache stores keys and values: as they are, or as 8- or 4-bit integers (`--kv-bits 8|4`).

A codec turns a (B, H, T, head_dim) tensor into a tuple of "parts", each (B, H, T, ...) with the token on
dim 2, so the cache can gather, scatter and concatenate tokens without knowing what a part holds, and back.

* `Plain`: one part, the tensor itself; `decode` returns the stored tensor (no copy, no cost).
* `Quantized`: asymmetric min/max quantization per token and per group of `group` channels (KIVI-style
  per-token groups; Liu et al., 2024, arXiv 2402.02750). For each group: `zero` = its minimum, `scale` =
  (max - min) / (2^bits - 1), both stored as fp16; code = round((x - zero) / scale) (round half to even),
  clamped to [0, 2^bits - 1]; 4-bit codes are packed two to a byte. Reading gives code * scale + zero. The
  error is at most half a step (scale / 2) plus the fp16 rounding of scale and zero: 2^-11 relative, and
  2^-24 absolute per step for groups narrower than ~2^-14 * 2^bits (tests/test_quant.py).
  Keys are quantized after RoPE, as the cache stores them. Bytes per token and KV head, for head_dim 64 and
  group 32: 64 (8-bit) or 32 (4-bit) for the codes, plus 8 for two fp16 scales and zeros.

Attention reads the decoded tensors: the slot count is unchanged, the stored bytes drop.
"""
from __future__ import annotations

import math

import torch

from .errors import UserError

KV_BITS = (4, 8)
GROUP = 32  # channels per scale, or the largest power of two that divides head_dim if smaller


def check_kv_bits(kv_bits: int | None) -> int | None:
    """None (unquantized), 8 or 4; anything else is a UserError."""
    if kv_bits is not None and kv_bits not in KV_BITS:
        raise UserError(f"kv_bits {kv_bits!r} must be one of {', '.join(map(str, KV_BITS))} (or None: unquantized)")
    return kv_bits


class Plain:
    """Keys and values stored in the model's dtype."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.bits = torch.finfo(dtype).bits

    def empty(self, batch: int, heads: int, slots: int, head_dim: int, device) -> tuple[torch.Tensor, ...]:
        return (torch.zeros(batch, heads, slots, head_dim, dtype=self.dtype, device=device),)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (x,)

    def decode(self, parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return parts[0]


class Quantized:
    """Keys and values stored as `bits`-bit codes with per-token, per-group fp16 scale and zero point."""

    def __init__(self, bits: int, head_dim: int, dtype: torch.dtype):
        check_kv_bits(bits)
        if bits == 4 and head_dim % 2:
            raise UserError(f"4-bit keys and values pack two channels a byte: head_dim {head_dim} is odd")
        self.bits, self.dtype, self.levels = bits, dtype, 2**bits - 1
        self.group = math.gcd(head_dim, GROUP)

    def empty(self, batch: int, heads: int, slots: int, head_dim: int, device) -> tuple[torch.Tensor, ...]:
        codes = torch.zeros(batch, heads, slots, head_dim * self.bits // 8, dtype=torch.uint8, device=device)
        scale = torch.zeros(batch, heads, slots, head_dim // self.group, dtype=torch.float16, device=device)
        return codes, scale, scale.clone()

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        g = x.float().unflatten(-1, (-1, self.group))  # (B, H, T, n_groups, group)
        lo, hi = g.amin(-1), g.amax(-1)  # (B, H, T, n_groups)
        scale, zero = ((hi - lo) / self.levels).half(), lo.half()
        step = scale.float().masked_fill(scale == 0, 1.0)  # a constant group: every code is 0
        codes = ((g - zero.float()[..., None]) / step[..., None]).round().clamp(0, self.levels).to(torch.uint8)
        codes = codes.flatten(-2)  # (B, H, T, head_dim)
        if self.bits == 4:
            codes = codes[..., 0::2] | (codes[..., 1::2] << 4)  # (B, H, T, head_dim / 2)
        return codes, scale, zero

    def decode(self, parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        codes, scale, zero = parts
        if self.bits == 4:
            codes = torch.stack((codes & 15, codes >> 4), -1).flatten(-2)
        g = codes.float().unflatten(-1, (-1, self.group))  # (B, H, T, n_groups, group)
        return (g * scale.float()[..., None] + zero.float()[..., None]).flatten(-2).to(self.dtype)


def codec(kv_bits: int | None, head_dim: int, dtype: torch.dtype) -> Plain | Quantized:
    """None: keys and values as they are; 8 or 4: quantized."""
    return Plain(dtype) if kv_bits is None else Quantized(kv_bits, head_dim, dtype)


def gather_slots(parts: tuple[torch.Tensor, ...], idx: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tokens at `idx` (B, H, S') of every part."""
    return tuple(p.gather(2, idx[..., None].expand(*idx.shape, p.shape[-1])) for p in parts)


def scatter_slots_(parts: tuple[torch.Tensor, ...], idx: torch.Tensor, new: tuple[torch.Tensor, ...]) -> None:
    """Overwrite the tokens at `idx` (B, H, S') of every part with `new`, in place."""
    for p, n in zip(parts, new):
        p.scatter_(2, idx[..., None].expand(*idx.shape, p.shape[-1]), n)


def cat_slots(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(torch.cat([x, y], 2) for x, y in zip(a, b))
