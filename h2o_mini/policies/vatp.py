"""`vatp`: value-aware token pruning (Guo et al., 2024, "Attention Score is not All You Need for Token
Importance Indicator in KV Cache Reduction: Value Also Matters", arXiv 2406.12335).

A token's contribution to an attention output is its attention times its value vector, so a token whose
value is small matters little however much attention it gets (attention sinks are the extreme case: much
attention, tiny values). VATP ranks tokens by accumulated attention times the L1 norm of the value:

    keep_j = s_j * ||v_j||_1     (s_j: H2O's accumulated attention; v_j: the cached value, as attention reads it)

and, like H2O, protects the `recent - 1` newest cached tokens and the arriving one; ties evict the oldest.
The paper keeps the first tokens too (attention sinks); here that is left to the rule itself (`--policy
sinks` shows the difference).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .h2o import H2O


@dataclass(frozen=True)
class VATP(H2O):
    """H2O's accumulated attention times each token's value L1 norm; a full cache evicts the lowest product
    outside the recent window (ties: the oldest)."""

    name = "vatp"

    def keep_score(self, score, pos, t, keys=None, values=None, state=None) -> torch.Tensor:
        importance = score * values.float().abs().sum(-1)  # (B, H, S)
        return torch.where(pos > t - self.recent, torch.inf, importance)
