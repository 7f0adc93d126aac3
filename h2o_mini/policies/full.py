"""`full`: keep every token (the dense baseline every other policy is compared with)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Policy


@dataclass(frozen=True)
class Full(Policy):
    """Keep every token: the cache is sized to the whole sequence and nothing is evicted (`keep_score` is
    never consulted)."""

    name = "full"
    takes_budget = False

    @property
    def capacity(self) -> None:
        return None

    def keep_score(self, score, pos, t, keys=None, values=None, state=None) -> torch.Tensor:
        return pos.float()
