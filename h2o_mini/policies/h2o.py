"""`h2o`: the Heavy-Hitter Oracle (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative
Inference of Large Language Models", arXiv 2306.14048, Algorithm 1 with a recent window).

The observation: a small set of tokens (the "heavy hitters") receives most of the attention, and which
tokens those are can be read off the attention already computed. So H2O keeps a cache of C = heavy + recent
tokens per layer and KV head and, each time a token arrives at a full cache:

1. every cached token j carries a score s_j: the sum of the attention probabilities it has received from
   every query since it entered the cache (fp32, never normalised; with GQA, summed over the group's heads);
2. the `recent - 1` newest cached tokens (and the arriving one) are protected: a local window;
3. among the others, the token with the lowest s_j is evicted for good (ties: the oldest).

With heavy = 0 this is `local`; with recent = 0 it is `heavy_hitter`. The cache does the bookkeeping
(`cache.py`); this class only says which tokens to keep.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Policy


@dataclass(frozen=True)
class H2O(Policy):
    """Keep the `recent` newest tokens and the `heavy` with the highest accumulated attention; a full cache
    evicts the lowest-scored token outside the recent window (ties: the oldest)."""

    heavy: int
    recent: int
    name = "h2o"
    takes_recent = True
    needs_scores = True

    @property
    def capacity(self) -> int:
        return self.heavy + self.recent

    def keep_score(self, score, pos, t, keys=None, values=None, state=None) -> torch.Tensor:
        recent_window = pos > t - self.recent  # the r-1 newest cached tokens (t itself is not cached yet)
        return torch.where(recent_window, torch.inf, score)

    def update(self, score: torch.Tensor, p: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Step 1 of the rule above: a query's attention (summed over its GQA group) is added to every score."""
        return score + p

    def accumulate(self, score: torch.Tensor, probs: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Q queries at once, (B, H, Q, S): their sum, in one op (a relative that changes `update`, as A2SF's
        forgetting factor does, takes the protocol's query-by-query form)."""
        if not adds_attention(self):
            return Policy.accumulate(self, score, probs, attended)
        return score + probs.sum(2)  # a query that attended nothing has probability 0 everywhere


def adds_attention(policy) -> bool:
    """Whether a rule's `update` is H2O's sum (as written here, checked or not: `guard.py` wraps a plugin's hooks),
    so that Q queries are one sum."""
    update = type(policy).update
    return getattr(update, "__wrapped__", update) is H2O.update
