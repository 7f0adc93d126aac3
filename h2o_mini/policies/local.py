"""`local`: a sliding window over the most recent tokens.

The "local" baseline of the H2O paper (Zhang et al., 2023, arXiv 2306.14048, Table/Fig. on
"Local" attention), also known as window attention (Beltagy et al., 2020, Longformer).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Policy


@dataclass(frozen=True)
class Local(Policy):
    """Keep the `recent` newest tokens; a full cache drops its oldest token."""

    recent: int
    name = "local"

    @property
    def capacity(self) -> int:
        return self.recent

    def keep_score(self, score, pos, t, keys=None, values=None, state=None) -> torch.Tensor:
        return pos.float()  # the lowest position, i.e. the oldest token, goes first
