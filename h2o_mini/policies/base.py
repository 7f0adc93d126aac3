"""The eviction-policy protocol, the registry, and the budget rules of `shared/spec/eviction.md`.

How the cache uses a policy (see `cache.py`): every layer, batch row and KV head holds at most C tokens.
When token t arrives and the cache is full, the cache asks the policy for a *keep-score* of every cached
token and overwrites the lowest one (ties: the oldest). Every cached token carries one fp32 `score` that the
policy alone interprets. A policy is a frozen dataclass of parameters (all state lives in the cache) with:

* `capacity`: C, the tokens kept per (layer, row, KV head); `None` means "the whole sequence".
  `layer_capacity(layer, n_layer, length)` may give each layer its own share (PyramidKV).
* `keep_score(score, pos, t, keys)`: higher means keep, +inf = protected. Inputs: the cached tokens'
  scores (fp32) and original positions (int64; < 0: an empty slot), both (B, n_kv_head, S), the
  arriving position `t` broadcastable to them, and, if `needs_keys`, their keys (B, n_kv_head, S, head_dim)
  as attention reads them, else None. Pure tensor code, no `.item()` and no Python branch on values, so
  it runs inside the compiled decode step. Keep-scores are element-wise per slot unless `needs_keys`: only
  then are all non-cached slots guaranteed a position < 0 (the stream loop's virtual slots).
* `insert_score(keys)`: the score a token enters with, from its key (B, H, T, hd) -> (B, H, T); H2O: 0.
* `accumulate(score, probs, attended)`: the scores after Q consecutive queries, in order. probs: their fp32
  attention (B, H, Q, S), summed over each GQA group; attended: (B, H, Q, S) bool, the tokens each query
  attended (all False for a query that does not count). H2O adds the probabilities; TOVA keeps the last.
  Called only if `needs_scores` (only then does the model compute explicit attention probabilities).
* Dense prefill: the scores are `accumulate` over the prompt's queries, only the last `prompt_window` of
  them if it is set (SnapKV's observation window), then `prompt_score` (SnapKV pools them); then the C
  prompt tokens with the highest keep-score at the last prompt position stay.

`takes_recent` says whether `--recent` means anything to it. A new policy is one file with one class,
added to `REGISTRY` in `policies/__init__.py`; the conformance and parity tests iterate over the registry,
so it is tested the moment it is registered.
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

    needs_keys: ClassVar[bool] = False  # whether keep_score reads the cached keys

    @property
    def capacity(self) -> int | None:
        raise NotImplementedError

    def layer_capacity(self, layer: int, n_layer: int, length: int) -> int:
        """Slots in layer `layer` for a sequence of `length` tokens: C in every layer, at most `length`."""
        return min(self.capacity or length, length)

    @property
    def prompt_window(self) -> int | None:
        """Dense prefill: how many of the last prompt queries shape the scores (None: all of them)."""
        return None

    def keep_score(self, score: torch.Tensor, pos: torch.Tensor, t: torch.Tensor,
                   keys: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def insert_score(self, keys: torch.Tensor) -> torch.Tensor:
        return keys.new_zeros(keys.shape[:-1], dtype=torch.float32)

    def accumulate(self, score: torch.Tensor, probs: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """H2O's rule: every query's attention is added (probs are 0 where a query did not attend)."""
        return score + probs.sum(2)

    def prompt_score(self, score: torch.Tensor) -> torch.Tensor:
        """Dense prefill: the prompt tokens' scores (B, H, T) once every prompt query is in."""
        return score

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
