"""The eviction-policy protocol, the registry, and the budget rules of `shared/spec/eviction.md`.

How the cache uses a policy (see `cache.py`): every layer, batch row and KV head holds at most C tokens.
When token t arrives and the cache is full, the cache asks the policy for a *keep-score* of every cached
token and overwrites the lowest one (ties: the oldest). A policy is therefore three small things:

* `capacity`: C, the tokens kept per (layer, row, KV head); `None` means "the whole sequence".
* `keep_score(score, pos, t)`: higher means keep. Inputs are the cached tokens' accumulated attention
  `score` (fp32) and original positions `pos` (int64), both (B, n_kv_head, S), and the arriving position
  `t` broadcastable to them. Return +inf for tokens that must not be evicted. Pure tensor code, no
  `.item()` and no Python branch on values, so it runs inside the compiled decode step.
* `needs_scores`: whether `keep_score` reads `score`. Only then does the model compute explicit
  attention probabilities and accumulate them (`accumulate`, by default a plain sum, as in H2O).

Policy objects hold parameters only (frozen dataclasses, checked when built: non-negative integers and
C >= 1); all state lives in the cache. `takes_recent` says whether `--recent` means anything to it.
A new policy is one file with one class, added to `REGISTRY` in `policies/__init__.py`; the conformance
tests iterate over the registry, so it is tested the moment it is registered.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import ClassVar

import torch

from ..errors import UserError


@dataclass(frozen=True)
class Policy:
    name: ClassVar[str] = ""
    needs_scores: ClassVar[bool] = False
    takes_recent: ClassVar[bool] = False  # whether --recent splits C for this policy

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise UserError(f"{type(self).__name__}: {f.name}={value!r} must be an integer >= 0")
        if self.capacity is not None and self.capacity < 1:
            raise UserError(f"{type(self).__name__}{tuple(getattr(self, f.name) for f in fields(self))}: the "
                            "capacity C must be at least one token")

    @property
    def capacity(self) -> int | None:
        raise NotImplementedError

    def keep_score(self, score: torch.Tensor, pos: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def accumulate(self, score: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """New scores from this step's attention `probs`, already summed over the GQA group."""
        return score + probs

    @classmethod
    def from_budget(cls, capacity: int, recent: int | None) -> "Policy":
        """The policy for a cache of `capacity` tokens (`recent` is only meaningful for windowed policies)."""
        raise NotImplementedError


BUDGET_HELP = ("a fraction in (0, 1] of the sequence length (0.2; 1.0 = everything) or an integer token count "
               "(256; 1 = one token)")


def parse_budget(text: str | float | int, what: str = "budget") -> float | int:
    """'0.2' -> 0.2 (a fraction), '256' -> 256 (a token count). Anything else is a UserError."""
    if isinstance(text, bool):
        raise UserError(f"{what} {text!r} is not a number")
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise UserError(f"{what} {text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise UserError(f"{what} {text!r} must be {BUDGET_HELP}")
    if value <= 1 and not (isinstance(text, int) or (isinstance(text, str) and text.strip().isdigit())):
        return value
    if value != int(value):
        raise UserError(f"{what} {text!r} must be {BUDGET_HELP}")
    if value > 2**31:
        raise UserError(f"{what} {text!r} is too large a token count")
    return int(value)


def capacity_for(budget: float | int, length: int) -> int:
    """C for a budget over a sequence of `length` tokens: fraction -> max(1, floor(x L + 0.5)); count -> itself."""
    if isinstance(budget, float):
        return max(1, math.floor(budget * length + 0.5))
    return budget


def recent_for(recent: str | float | int | None, capacity: int) -> int | None:
    """The recent share of C: None (the policy's default), 0, a fraction of C, or a token count <= C."""
    if recent is None:
        return None
    if str(recent).strip() in ("0", "0.0"):
        return 0
    share = parse_budget(recent, what="--recent")
    count = math.floor(share * capacity + 0.5) if isinstance(share, float) else share
    if count > capacity:
        raise UserError(f"--recent {recent} is larger than the capacity {capacity}, leaving a negative heavy share")
    return count


def describe(cls: type[Policy]) -> str:
    """The rule of a policy class: its class docstring's first paragraph, on one line."""
    doc = (cls.__doc__ or "").strip().split("\n\n")[0]
    return " ".join(doc.split())
