"""The value-norm plugin of docs/policies.md ("Write your own policy"), as a file outside the registry: what
scripts/transformers/run.sh runs through both engines."""
from dataclasses import dataclass

import torch

from h2o_mini import Policy, param


@dataclass(frozen=True)
class VNorm(Policy):
    """Keep the `recent` newest tokens and the ones whose value vectors are largest (norm to the power `power`)."""

    keep: int
    recent: int
    power: float = param(1.0, lo=0.5, hi=4.0)
    name = "vnorm"
    takes_recent = True

    @property
    def capacity(self):
        return self.keep + self.recent

    def keep_score(self, score, pos, t, keys=None, values=None, state=None):
        recent = pos > t - self.recent - 1
        return torch.where(recent, torch.inf, values.norm(dim=-1) ** self.power)

    @classmethod
    def from_budget(cls, capacity, recent):
        recent = capacity // 2 if recent is None else recent
        return cls(keep=capacity - recent, recent=recent)
