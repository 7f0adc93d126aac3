"""`keydiff`: KeyDiff (Park et al., 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context
LLM Inference in Resource-Constrained Environments", arXiv 2504.15364).

Tokens whose keys point where most keys point add little that the others do not already give; distinctive
keys are kept. The anchor is the mean of the cached keys, each scaled to unit length first (so a few large
keys do not set the direction); the token whose key has the highest cosine similarity to the anchor is
evicted. When token t arrives the anchor is the mean over the C cached tokens (t itself is inserted after
the eviction). Needs no attention probabilities: the SDPA path stays. In dense prefill the anchor is the
mean over all prompt keys.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import Policy


@dataclass(frozen=True)
class KeyDiff(Policy):
    """Keep the `keep` most distinctive keys; a full cache evicts the key most similar (cosine) to the mean of
    the cached unit keys (ties: the oldest)."""

    keep: int
    name = "keydiff"

    @property
    def capacity(self) -> int:
        return self.keep

    def keep_score(self, score, pos, t, keys=None, values=None, state=None) -> torch.Tensor:
        unit = F.normalize(keys.float(), dim=-1)  # (B, H, S, hd)
        cached = (pos >= 0)[..., None]  # (B, H, S, 1)
        anchor = (unit * cached).sum(2, keepdim=True) / cached.sum(2, keepdim=True).clamp(min=1)  # (B, H, 1, hd)
        return -(unit * F.normalize(anchor, dim=-1)).sum(-1)  # minus the cosine: similar keys go first
