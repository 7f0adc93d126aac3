"""`knorm`: keep the keys with the lowest L2 norm (Devoto et al., 2024, "A Simple and Effective L2
Norm-Based Strategy for KV Cache Compression", arXiv 2406.11430).

Keys with a low norm tend to receive high attention (the attention sinks among them), so a key's norm,
known as soon as the key is computed, is a proxy for its importance that needs no attention
probabilities: this policy keeps the SDPA attention path. The score a token enters with is minus its
key's norm (after RoPE, which preserves norms; each KV head has its own key), rounded to bfloat16 so that
norms equal up to rounding tie (then the oldest goes), and it never changes. No protected window: the arriving token is always inserted, and evicted at the next step
if its key is the largest.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Policy


@dataclass(frozen=True)
class KNorm(Policy):
    """Keep the `keep` tokens whose keys have the lowest L2 norm; a full cache evicts the largest key
    (ties: the oldest)."""

    keep: int
    name = "knorm"

    @property
    def capacity(self) -> int:
        return self.keep

    def insert_score(self, keys: torch.Tensor) -> torch.Tensor:
        # bf16 (8 significant bits): one token's keys at different positions have the same norm (RoPE
        # rotates them) up to rounding, and must tie, so that the older goes first on every code path
        return -keys.double().norm(dim=-1).bfloat16().float()  # (B, H, T); fp64: no path rounds across a bf16 step

    def keep_score(self, score, pos, t, keys=None, values=None, state=None) -> torch.Tensor:
        return score
