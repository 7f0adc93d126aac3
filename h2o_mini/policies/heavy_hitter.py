"""`heavy_hitter`: keep the tokens that have received the most attention so far, with no recent window.

H2O's ablation without the local window (Zhang et al., 2023, arXiv 2306.14048, Sec. 5 / Table 9):
the score of a token is the sum of the attention probabilities it has received from every query since it
entered the cache, summed over the query heads that share its KV head.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Policy
from .h2o import H2O


@dataclass(frozen=True)
class HeavyHitter(Policy):
    """Keep the `heavy` tokens with the highest accumulated attention; evict the lowest (ties: the oldest)."""

    heavy: int
    name = "heavy_hitter"
    needs_scores = True

    @property
    def capacity(self) -> int:
        return self.heavy

    def keep_score(self, score, pos, t, keys=None, values=None, state=None) -> torch.Tensor:
        return score

    update, accumulate = H2O.update, H2O.accumulate  # H2O's scores (policies/h2o.py)
