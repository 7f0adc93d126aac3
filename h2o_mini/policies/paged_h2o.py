"""`paged_h2o`: H2O at the granularity of pages, as a paged serving engine (vLLM's PagedAttention, Kwon et al.,
2023, arXiv 2309.06180) could apply it: memory comes in blocks of `block` consecutive positions, and freeing
one token inside a block frees nothing. So the tokens of a block are judged together, by the sum of their
accumulated attention (H2O's scores), and the lowest block is drained:

    keep_j = sum of s_i over the cached tokens i with p_i // block == p_j // block

The `recent - 1` newest cached tokens and the arriving one are protected, as in `h2o`; ties evict the oldest.
This cache evicts one token per step (the spec's rule), so a block leaves one token at a time: once a
block is the lowest it stays the lowest (its sum only falls as its tokens go, the others' only rise) and is
emptied before another block is touched, except when a new token's attention lifts it. With block = 1 it
is `h2o`. What it costs against `h2o` is the price of page granularity (docs/results.md).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import param
from .h2o import H2O


@dataclass(frozen=True)
class PagedH2O(H2O):
    """H2O by pages: a token's keep-score is the summed score of its block of `block` consecutive positions;
    a full cache evicts from the lowest block outside the recent window (ties: the oldest)."""

    block: int = param(16, lo=1)
    name = "paged_h2o"

    def keep_score(self, score, pos, t, keys=None, values=None, state=None) -> torch.Tensor:
        page = torch.where(pos >= 0, torch.div(pos, self.block, rounding_mode="floor"), -1)  # (B, H, S)
        order = page.argsort(dim=-1, stable=True)
        sorted_page = page.gather(-1, order)
        running = F.pad(score.masked_fill(pos < 0, 0.0).gather(-1, order).cumsum(-1), (1, 0))  # (B, H, S + 1)
        first = torch.searchsorted(sorted_page, page)  # where each token's page starts and ends in sorted order
        last = torch.searchsorted(sorted_page, page, right=True)
        page_sum = running.gather(-1, last) - running.gather(-1, first)  # the same value for every token of a page
        return torch.where(pos > t - self.recent, torch.inf, page_sum)
