"""`rkv`: redundancy-aware eviction (Cai et al., 2025, "R-KV: Redundancy-aware KV Cache Compression for
Reasoning Models", arXiv 2505.24133).

Long generations repeat themselves, and a token whose key looks like many other cached keys adds little
that they do not already give. R-KV keeps tokens that are important *and* not redundant:

    keep_j = lam * s_j / mean_i(s_i)  -  (1 - lam) * r_j

where s_j is H2O's accumulated attention (divided by its mean over the cached tokens, so it is ~1 whatever
the sequence length) and r_j the mean cosine similarity of key j to the other cached keys. With unit keys
u_i, r_j = (u_j . sum_i u_i - 1) / (n - 1) exactly, so it costs O(C * head_dim) per step, not the
O(C^2 * head_dim) of the similarity matrix: it fits the compiled step's fixed shapes. The `recent - 1`
newest and the arriving token are protected; ties evict the oldest. Differences from the paper: the
importance here is accumulated over every query (the paper's comes from a window of recent queries, and
it thresholds the similarity matrix before averaging), and eviction is one token per step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import param
from .h2o import H2O


@dataclass(frozen=True)
class RKV(H2O):
    """Importance minus redundancy: `lam` x accumulated attention (over its mean) - (1 - `lam`) x mean cosine
    of the key to the other cached keys; a full cache evicts the lowest outside the recent window."""

    lam: float = param(0.5, lo=0.0, hi=1.0)
    name = "rkv"

    def keep_score(self, score, pos, t, keys=None, values=None, state=None) -> torch.Tensor:
        cached = pos >= 0  # (B, H, S)
        n = cached.sum(-1, keepdim=True).float()  # (B, H, 1)
        unit = F.normalize(keys.float(), dim=-1) * cached[..., None]  # (B, H, S, hd), 0 where not cached
        redundancy = ((unit * unit.sum(2, keepdim=True)).sum(-1) - 1) / (n - 1).clamp(min=1)  # (B, H, S)
        mean = (score * cached).sum(-1, keepdim=True) / n.clamp(min=1)
        importance = score / mean.clamp(min=1e-6)
        keep = self.lam * importance - (1 - self.lam) * redundancy
        return torch.where(pos > t - self.recent, torch.inf, keep)
