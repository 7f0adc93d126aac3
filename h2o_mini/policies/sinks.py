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
from ..errors import UserError


@dataclass(frozen=True)
class Sinks(Policy):
    """Keep the `sink` first tokens and the `recent` newest; a full cache drops the oldest of the rest."""

    sink: int
    recent: int
    name = "sinks"
    takes_recent = True

    def __post_init__(self):
        super().__post_init__()
        if self.recent < 1:  # the arriving token would find every slot a sink
            raise UserError(f"{self}: every one of its {self.capacity} slots is protected when the first token must "
                            "be evicted, so the arriving token cannot be placed; give it a recent share (--recent)")

    @property
    def capacity(self) -> int:
        return self.sink + self.recent

    def keep_score(self, score, pos, t, keys=None, values=None, state=None) -> torch.Tensor:
        return torch.where(pos < self.sink, torch.inf, pos.float())

    @classmethod
    def from_budget(cls, capacity: int, recent: int | None) -> "Sinks":
        sink = min(4, capacity - 1) if recent is None else capacity - recent
        return cls(sink=sink, recent=capacity - sink)
