"""The eviction-policy protocol, the registry's parameter rules, and the budget rules of `docs/spec.md`.

How the cache uses a policy (`cache.py`; the contract is `docs/spec.md`): every layer, batch row and KV head
holds at most C tokens. When token t arrives and the cache is full, the cache asks the policy for a
*keep-score* of every cached token and overwrites the lowest one (ties: the oldest). Every cached token
carries one fp32 `score` that the policy alone interprets. A policy is a frozen dataclass of parameters (all
state lives in the cache) with these hooks; each has a default that is H2O's behaviour:

* `capacity`: C, the tokens kept per (layer, row, KV head); `None` means "the whole sequence".
  `layer_capacity(layer, n_layer, length)` may give each layer its own share (PyramidKV), and
  `for_layer(layer, n_layer)` the policy that layer runs (a per-layer rule; default: this one).
* `keep_score(score, pos, t, keys, values)`: higher means keep, +inf = protected. Inputs: the cached tokens'
  scores (fp32) and original positions (int64; < 0: an empty slot), both (B, n_kv_head, S), the
  arriving position `t` broadcastable to them, and their keys / values (B, n_kv_head, S, head_dim) as
  attention reads them if the class sets `needs_keys` / `needs_values` (else None; `values` is passed only
  to a class that sets `needs_values`). Pure tensor code, no `.item()` and no Python branch on values, so it
  runs inside the compiled decode step. Keep-scores are element-wise per slot unless the class sets
  `needs_keys`, `needs_values` or `across_slots`: only then are all non-cached slots guaranteed a position < 0
  (the stream loop's virtual slots), so that a rule across slots (a mean key, a page's sum) can skip them.
* `insert_score(keys)`: the score a token enters with, from its key (B, H, T, hd) -> (B, H, T); H2O: 0.
* `update(score, p, attended)`: what ONE query does to the scores, (B, H, S) each: p its fp32 attention
  summed over the GQA group (0 where it did not attend), attended which tokens it attended. H2O: s + p.
  Called only if `needs_scores` (only then are attention probabilities computed explicitly).
  `accumulate(score, probs, attended)` applies Q consecutive queries (B, H, Q, S) in order; its default
  calls `update` once per query, and a policy may override it with a closed form for speed (H2O's sum is
  built in); `h2o-mini check-policy` checks that the two agree.
* Dense prefill: the scores are `accumulate` over the prompt's queries, only the last `prompt_window` of
  them if it is set (SnapKV's observation window), then `prompt_score` (SnapKV pools them); then the C
  prompt tokens with the highest keep-score at the last prompt position stay.

A policy that reads the text ahead sets `lookahead` (`hindsight.py`): the cache refuses it (`check_causal`), and only
the evaluation that has the whole text runs it (`evals/hindsight.py`).

Parameters are the dataclass fields: int, float or bool, checked by their annotations when the policy is
made (an int is >= 0 unless its range says otherwise; a float is finite); `param(default, lo=, hi=)`
declares a range. `from_budget(capacity, recent)` maps `--budget`/`--recent` onto them (`takes_budget`:
False for a policy that keeps everything; `takes_recent`: whether --recent means anything to it); the CLI
sets any other field by name (`--policy a2sf:gamma=0.9`). A policy whose every slot is protected at the first
eviction (so the arriving token could not be placed) is refused when it is made.
"""
from __future__ import annotations

import math
import typing
from dataclasses import MISSING, dataclass, field, fields
from typing import ClassVar

import torch

from ..errors import UserError

TYPES = (bool, int, float)


def param(default=MISSING, *, lo: float | None = None, hi: float | None = None):
    """A policy parameter with a declared range [lo, hi] (either may be None): `gamma: float = param(0.9, lo=0, hi=1)`."""
    return field(default=default, metadata={"lo": lo, "hi": hi})


@dataclass(frozen=True)
class Policy:
    name: ClassVar[str] = ""
    needs_scores: ClassVar[bool] = False  # update/accumulate see attention probabilities
    needs_keys: ClassVar[bool] = False  # keep_score reads the cached keys
    needs_values: ClassVar[bool] = False  # keep_score reads the cached values
    across_slots: ClassVar[bool] = False  # keep_score reads other slots (their scores or positions), not one alone
    takes_recent: ClassVar[bool] = False  # whether --recent splits C for this policy
    takes_budget: ClassVar[bool] = True  # False: the policy keeps every token (full)
    lookahead: ClassVar[bool] = False  # True: it reads the text ahead (hindsight), so only an evaluation runs it

    def __post_init__(self):
        hints = typing.get_type_hints(type(self))
        for f in fields(self):
            object.__setattr__(self, f.name, check_param(type(self).__name__, f, hints.get(f.name),
                                                         getattr(self, f.name)))
        if self.capacity is not None and self.capacity < 1:
            raise UserError(f"{self}: the capacity C must be at least one token")
        if self.capacity is not None and self._all_protected(self.capacity):
            raise UserError(f"{self}: every one of its {self.capacity} slots is protected when the first token "
                            "must be evicted, so the arriving token cannot be placed; give it a smaller protected "
                            "share (e.g. --recent) or a larger --budget")

    def _all_protected(self, C: int) -> bool:
        """Whether keep_score protects every slot of a full cache (positions 0..C-1) when token C arrives."""
        cpu = torch.device("cpu")  # explicit: a test may have set another default device
        pos = torch.arange(C, device=cpu)[None, None]  # (1, 1, C)
        kv = torch.randn(1, 1, C, 8, generator=torch.Generator().manual_seed(0), device=cpu)
        keep = keep_scores(self, torch.zeros(1, 1, C, device=cpu), pos, torch.tensor(C, device=cpu), kv, kv)
        return bool((keep == torch.inf).all())

    @property
    def capacity(self) -> int | None:
        raise NotImplementedError

    def layer_capacity(self, layer: int, n_layer: int, length: int) -> int:
        """Slots in layer `layer` for a sequence of `length` tokens: C in every layer, at most `length`."""
        return min(self.capacity or length, length)

    def for_layer(self, layer: int, n_layer: int) -> "Policy":
        """The policy layer `layer` runs (a per-layer rule returns a copy with its own parameters)."""
        return self

    @property
    def prompt_window(self) -> int | None:
        """Dense prefill: how many of the last prompt queries shape the scores (None: all of them)."""
        return None

    def keep_score(self, score: torch.Tensor, pos: torch.Tensor, t: torch.Tensor,
                   keys: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def insert_score(self, keys: torch.Tensor) -> torch.Tensor:
        return keys.new_zeros(keys.shape[:-1], dtype=torch.float32)

    def update(self, score: torch.Tensor, p: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """One query: H2O's rule, its attention is added (p is 0 where it did not attend)."""
        return score + p

    def accumulate(self, score: torch.Tensor, probs: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Q queries in order, (B, H, Q, S): `update` once per query that attended something (a query that does
        not count, such as padding or one before SnapKV's window, leaves the scores alone); H2O's sum in one
        op when `update` is H2O's."""
        if type(self).update is Policy.update:
            return score + probs.sum(2)
        for i in range(probs.shape[2]):
            counts = attended[:, :, i].any(-1, keepdim=True)  # (B, H, 1)
            score = torch.where(counts, self.update(score, probs[:, :, i], attended[:, :, i]), score)
        return score

    def prompt_score(self, score: torch.Tensor) -> torch.Tensor:
        """Dense prefill: the prompt tokens' scores (B, H, T) once every prompt query is in."""
        return score

    @classmethod
    def from_budget(cls, capacity: int, recent: int | None) -> "Policy":
        """The policy for a cache of `capacity` tokens (`recent` is only meaningful for windowed policies)."""
        raise NotImplementedError

    def params(self) -> dict:
        """Every parameter by name: what JSON outputs and sweep rows record."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def keep_scores(policy: Policy, score, pos, t, keys=None, values=None) -> torch.Tensor:
    """The policy's keep-scores, called as the protocol says: keys only to a policy that `needs_keys`, values
    (by keyword) only to one that `needs_values`. Every caller (the cache's paths, the references) uses this."""
    keys = keys if policy.needs_keys else None
    if policy.needs_values:
        return policy.keep_score(score, pos, t, keys, values=values)
    return policy.keep_score(score, pos, t, keys)


def keeps_all_of(policy: Policy, length: int) -> bool:
    """Whether the policy keeps every token of a sequence of `length` (its C, the mean over layers, covers it).
    Such a row is run alone, not batched with others (`Rows`): its slots would widen every row's."""
    return (policy.capacity or length) >= length


def check_causal(policy: Policy) -> None:
    """Refuses a policy that reads the text ahead (hindsight) wherever tokens are taken one at a time."""
    if policy.lookahead:
        raise UserError(f"policy {policy.name!r} reads the text ahead (it keeps what future queries will attend), "
                        "so only 'eval ppl' and 'eval sweep ppl' can run it")


def check_param(owner: str, f, kind, value):
    """A parameter's value checked against its annotation (int, float or bool) and declared range."""
    if kind not in TYPES:
        raise UserError(f"{owner}: parameter {f.name} must be annotated int, float or bool (got {kind!r})")
    lo, hi = f.metadata.get("lo", 0 if kind is int else None), f.metadata.get("hi")
    where = " in [" + ("-inf" if lo is None else f"{lo}") + ", " + ("inf" if hi is None else f"{hi}") + "]"
    if kind is bool:
        if not isinstance(value, bool):
            raise UserError(f"{owner}: {f.name}={value!r} must be true or false")
        return value
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise UserError(f"{owner}: {f.name}={value!r} must be an integer{where}")
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise UserError(f"{owner}: {f.name}={value!r} must be a finite number{where}")
        value = float(value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise UserError(f"{owner}: {f.name}={value!r} must be{where}")
    return value


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
