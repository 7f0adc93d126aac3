"""`scissorhands`: the persistence of importance (Liu et al., 2023, "Scissorhands: Exploiting the
Persistence of Importance Hypothesis for LLM KV Cache Compression at Test Time", arXiv 2305.17118).

Tokens that were pivotal once tend to stay pivotal, so Scissorhands counts, over a history window of the
last `window` queries, how often each token was important, and drops the token that was important least
often, never one of the `recent` newest. The exact rule implemented here, per layer, row and KV head:

* a query finds token j *important* when the attention it gives j, summed over the GQA group's query
  heads, is at least the group's uniform share: the group's total attention divided by the number of
  tokens the query attended (the paper's threshold 1/t, over the tokens actually cached);
* a token's score holds the last `window` such verdicts as bits, newest lowest: an integer below
  2^window, kept exactly in the fp32 score (hence window <= 24); each query shifts it left by one;
* keep-score: how many of those bits are set; the `recent - 1` newest cached tokens and the arriving one
  are protected (as in `h2o`); ties evict the oldest.

The paper drops m tokens at once when the cache fills; here one token goes per step, like every policy of
this cache. In dense prefill the bits come from the last `window` prompt queries.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Policy
from ..errors import UserError

MAX_WINDOW = 24  # fp32 holds every integer below 2^24 exactly


def popcount(x: torch.Tensor) -> torch.Tensor:
    """Set bits of each int32 below 2^24, in 10 element-wise ops: pairs, nibbles, then bytes summed."""
    x = x - ((x >> 1) & 0x555555)
    x = (x & 0x333333) + ((x >> 2) & 0x333333)
    x = (x + (x >> 4)) & 0x0F0F0F
    return (x + (x >> 8) + (x >> 16)) & 0x3F


@dataclass(frozen=True)
class Scissorhands(Policy):
    """Keep the `recent` newest tokens and the `heavy` most often important over the last `window` queries
    (attention at least the uniform share); a full cache evicts the least often important (ties: the oldest)."""

    heavy: int
    recent: int
    window: int = 16
    name = "scissorhands"
    takes_recent = True
    needs_scores = True

    def __post_init__(self):
        super().__post_init__()
        if not 1 <= self.window <= MAX_WINDOW:
            raise UserError(f"Scissorhands: window={self.window} must be in [1, {MAX_WINDOW}]")

    @property
    def capacity(self) -> int:
        return self.heavy + self.recent

    def keep_score(self, score, pos, t, keys=None, values=None, state=None) -> torch.Tensor:
        important = popcount(score.to(torch.int32))  # set bits of the history window (all it holds)
        return torch.where(pos > t - self.recent, torch.inf, important.float())

    def update(self, score: torch.Tensor, p: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """One query: shift the history one place (the oldest verdict falls out) and add this query's verdict."""
        n = attended.sum(-1, keepdim=True).clamp(min=1)  # (B, H, 1) tokens the query attended
        important = attended & (p * n >= p.sum(-1, keepdim=True))  # at least the uniform share
        return torch.remainder(score * 2.0, 2.0 ** self.window) + important.float()

    def accumulate(self, score: torch.Tensor, probs: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """`update` over Q queries at once (dense prefill): each counting query's verdict, shifted by the
        number of counting queries after it; a query that attended nothing shifts nothing."""
        n = attended.sum(-1, keepdim=True).clamp(min=1)  # (B, H, Q, 1) tokens each query attended
        important = attended & (probs * n >= probs.sum(-1, keepdim=True))  # (B, H, Q, S)
        counts = attended.any(-1).float()  # (B, H, Q)
        w = self.window
        after = counts.flip(-1).cumsum(-1).flip(-1) - counts  # counting queries after each one
        weight = torch.where(after < w, 2.0 ** after.clamp(max=w - 1), 0.0) * counts  # older verdicts fall out
        total = counts.sum(-1, keepdim=True).clamp(max=w)  # (B, H, 1)
        shifted = torch.remainder(score * 2.0 ** total, 2.0 ** w)  # exact: powers of two, below 2^24
        return shifted + (important.float() * weight[..., None]).sum(2)
