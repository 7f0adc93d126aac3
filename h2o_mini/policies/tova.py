"""`tova`: Token Omission Via Attention (Oren et al., 2024, "Transformers are Multi-State RNNs",
arXiv 2401.06104).

TOVA keeps, at every step, the tokens that the *current* query attends to most: a token's score is the
attention it received from the most recent query alone (summed over the query heads of its GQA group),
replaced at every step, never accumulated. There is no protected window: even a recent token goes if the
last query ignored it. The paper attends over C + 1 tokens and then drops the lowest; this cache evicts
before it inserts, so the signal available when token t arrives is the attention of query t - 1, and
the token t itself is always inserted. In dense prefill the scores are the last prompt query's attention.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Policy


@dataclass(frozen=True)
class TOVA(Policy):
    """Keep the `keep` tokens the latest query attended to most; a full cache evicts the token with the least
    attention from the previous query (summed over its GQA group; ties: the oldest)."""

    keep: int
    name = "tova"
    needs_scores = True

    @property
    def capacity(self) -> int:
        return self.keep

    def keep_score(self, score, pos, t, keys=None, values=None, state=None) -> torch.Tensor:
        return score

    def update(self, score: torch.Tensor, p: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        return p  # replaced: only the latest query counts

    def accumulate(self, score: torch.Tensor, probs: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        return probs[:, :, -1]  # the closed form of `update` over Q queries: the last one's attention
