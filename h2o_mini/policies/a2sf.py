"""`a2sf`: Accumulative Attention Score with Forgetting factor (Jo and Shin, 2024, "A2SF: Accumulative
Attention Scoring with Forgetting Factor for Token Pruning in Transformer Decoder", arXiv 2407.20485).

H2O adds every query's attention to a token's score, so a token that has been cached for long has had more
queries to collect from than a young one: old tokens win by seniority. A2SF discounts the past: each query
first multiplies every score by a forgetting factor gamma < 1, then adds its attention. With gamma = 1 it
is H2O. The rule, per layer, row and KV head, written for one query (`update`); the cache derives the
chunked and dense forms from it:

    s_j <- gamma * s_j + p_j     (p_j: the query's attention to j, summed over the GQA group)

Eviction is H2O's: the `recent - 1` newest cached tokens and the arriving one are protected, the lowest
score among the rest goes (ties: the oldest). The paper tunes gamma per model and task; the default 0.99
here is one point of the sweep in docs/results.md, not the paper's universal value (it gives none).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import param
from .h2o import H2O


@dataclass(frozen=True)
class A2SF(H2O):
    """H2O with a forgetting factor: each query scales every score by `gamma` before adding its attention; a
    full cache evicts the lowest-scored token outside the recent window (ties: the oldest)."""

    gamma: float = param(0.99, lo=0.0, hi=1.0)
    name = "a2sf"

    def update(self, score: torch.Tensor, p: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        return self.gamma * score + p
