"""`sinks`: a local window plus the first few tokens, kept forever ("attention sinks").

StreamingLLM (Xiao et al., 2023, "Efficient Streaming Language Models with Attention Sinks",
arXiv 2309.17453) observed that the first tokens soak up attention whatever they say; dropping them
hurts a window cache badly, keeping four of them fixes most of it. This file is the worked example of
`docs/policies.md`: a new policy in a dozen lines, tested by the registry's conformance tests.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Policy


@dataclass(frozen=True)
class Sinks(Policy):
    """Keep the `sink` first tokens and the `recent` newest; a full cache drops the oldest of the rest."""

    sink: int
    recent: int
    name = "sinks"
    takes_recent = True

    @property
    def capacity(self) -> int:
        return self.sink + self.recent

    def keep_score(self, score: torch.Tensor, pos: torch.Tensor, t: torch.Tensor, keys=None,
                   values=None) -> torch.Tensor:
        return torch.where(pos < self.sink, torch.inf, pos.float())

    @classmethod
    def from_budget(cls, capacity: int, recent: int | None) -> "Sinks":
        sink = min(4, capacity - 1) if recent is None else capacity - recent
        return cls(sink=sink, recent=capacity - sink)
