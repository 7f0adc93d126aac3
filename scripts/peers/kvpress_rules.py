"""h2o-mini policies with kvpress 0.5.5's rule where the two differ, written as plugins (any file can hold a
policy). `kvpress_check.py` runs each beside kvpress's press: equal kept sets then show that the difference
is the rule named here, and nothing else."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from h2o_mini.policies import HeavyHitter, KNorm, SnapKV, TOVA


@dataclass(frozen=True)
class ExactKNorm(KNorm):
    """KnormPress: the exact fp32 key norm (h2o-mini rounds it to bf16 so that every code path ties alike)."""

    def insert_score(self, keys: torch.Tensor) -> torch.Tensor:
        return -keys.float().norm(dim=-1)


@dataclass(frozen=True)
class AvgPoolSnapKV(SnapKV):
    """SnapKVPress: the window's attention average-pooled (zeros padded) over `kernel` neighbours, where
    h2o-mini max-pools."""

    def prompt_score(self, score: torch.Tensor) -> torch.Tensor:
        B, H, T = score.shape
        return F.avg_pool1d(score.view(B * H, 1, T), self.kernel, stride=1, padding=self.kernel // 2).view(B, H, T)


@dataclass(frozen=True)
class SharedTOVA(TOVA):
    """TOVAPress: the last query's attention averaged over every query head, one choice shared by all KV heads,
    the newest token always kept (h2o-mini: per KV head, its GQA group's sum, nothing protected)."""

    def accumulate(self, score, probs, attended):
        return probs[:, :, -1].sum(1, keepdim=True).expand_as(score)

    def keep_score(self, score, pos, t, keys=None, values=None, state=None):
        return torch.where(pos == t, torch.inf, score)


@dataclass(frozen=True)
class MeanObserved(HeavyHitter):
    """ObservedAttentionPress: the attention a prompt token received divided by how many queries could see it
    (a mean), where H2O's heavy hitters sum it."""

    def prompt_score(self, score: torch.Tensor) -> torch.Tensor:
        T = score.shape[-1]
        return score / torch.arange(T, 0, -1, device=score.device, dtype=score.dtype)
