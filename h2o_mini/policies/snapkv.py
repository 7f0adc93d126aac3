"""`snapkv`: SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation",
arXiv 2404.14469).

The last prompt tokens (the *observation window*, where a question usually sits) already attend to what
the answer will need. So at the end of a dense prefill SnapKV scores every prompt token by the attention it
receives from the last `window` prompt queries only (summed over them and the GQA group), smooths the
scores by max-pooling over neighbouring positions (kernel `kernel`, so a kept token brings its
neighbours' evidence: clusters, not isolated tokens), and keeps the `heavy` best plus the window itself.

SnapKV compresses the prompt only; here decoding then goes on by the H2O rule with those scores carried
over (new attention is added; the `window` newest are protected). In stream mode, where no prompt is seen
as a whole, it is exactly `h2o` with heavy = `heavy` and recent = `window`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import Policy
from .h2o import H2O
from ..errors import UserError


@dataclass(frozen=True)
class SnapKV(Policy):
    """Dense prefill keeps the `window` last prompt tokens and the `heavy` that the window's queries attend to
    most (max-pooled over `kernel` neighbours); decoding then evicts by the H2O rule (recent = `window`)."""

    heavy: int
    window: int
    kernel: int = 7
    name = "snapkv"
    takes_recent = True  # --recent sets the observation window
    needs_scores = True

    def __post_init__(self):
        super().__post_init__()
        if self.kernel % 2 == 0:
            raise UserError(f"{type(self).__name__}: kernel={self.kernel} must be odd (centred pooling)")

    @property
    def capacity(self) -> int:
        return self.heavy + self.window

    @property
    def prompt_window(self) -> int:
        return max(self.window, 1)

    def keep_score(self, score, pos, t, keys=None, values=None, state=None) -> torch.Tensor:
        return torch.where(pos > t - self.window, torch.inf, score)

    update, accumulate = H2O.update, H2O.accumulate  # H2O's scores (policies/h2o.py), over the window's queries

    def prompt_score(self, score: torch.Tensor) -> torch.Tensor:
        B, H, T = score.shape  # max-pool over neighbouring positions, the same length out
        return F.max_pool1d(score.view(B * H, 1, T), self.kernel, stride=1, padding=self.kernel // 2).view(B, H, T)

    @classmethod
    def from_budget(cls, capacity: int, recent: int | None) -> "SnapKV":
        window = min(32, capacity - capacity // 2) if recent is None else recent
        return cls(heavy=capacity - window, window=window)
