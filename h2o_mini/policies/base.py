"""The eviction-policy protocol (the contract, with every hook and when it runs: `docs/spec.md`), the
parameter rules of a policy's fields, and the budget rules.

A policy is a frozen dataclass of parameters; all state lives in the cache. The one hook every rule writes is
`keep_score(score, pos, t, keys=None, values=None, state=None)`, with that one signature for every rule: higher
keeps, +inf protects; the cache evicts the lowest (ties: the oldest). A rule that reads attention also says how
a query's attention changes a token's score (`update`; H2O's sum is `policies/h2o.py`'s, which its relatives
reuse). Every other hook has a default that leaves things as they are. The class flags, each for one reason:

* `needs_scores`: the rule reads attention, so the cache computes fp32 probabilities and calls `update`
  (a rule that reads none keeps SDPA's fused attention and never pays for them).
* `takes_budget`: False for a policy that keeps every token (`full`), so `--budget` is refused for it.
* `takes_recent`: `--recent` means something to it (it splits C into a protected window and the rest).
* `lookahead`: it reads the text ahead (`hindsight`): commands that run a text causally refuse it
  (`refuse_lookahead`), and only the evaluation that has the whole text runs it (`evals/hindsight.py`).

Parameters are the dataclass fields: int, float, bool or str (a file the rule reads), checked by their
annotations when the policy is made (an int is >= 0 unless its range says otherwise; a float is finite);
`param(default, lo=, hi=)` declares a range. Making a policy runs none of its hooks: a plugin's hooks are checked
where they first run (`guard.py`) and by `check-policy`.
"""
from __future__ import annotations

import inspect
import math
import typing
from dataclasses import MISSING, dataclass, field, fields
from typing import ClassVar

import torch

from ..errors import UserError

TYPES = (bool, int, float, str)


def param(default=MISSING, *, lo: float | None = None, hi: float | None = None):
    """A policy parameter with a declared range [lo, hi] (either may be None): `gamma: float = param(0.9, lo=0, hi=1)`."""
    return field(default=default, metadata={"lo": lo, "hi": hi})


@dataclass(frozen=True)
class Policy:
    name: ClassVar[str] = ""
    needs_scores: ClassVar[bool] = False  # update/accumulate see attention probabilities
    takes_recent: ClassVar[bool] = False  # whether --recent splits C for this policy
    takes_budget: ClassVar[bool] = True  # False: the policy keeps every token (full)
    lookahead: ClassVar[bool] = False  # True: it reads the text ahead (hindsight), so only an evaluation runs it

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        check_signature(cls)
        if cls.needs_scores and cls.update is Policy.update:
            raise UserError(f"{cls.__name__} reads attention (needs_scores) but writes no update(score, p, attended): "
                            "say how a query's attention changes a score (H2O's sum: `update, accumulate = H2O.update, "
                            "H2O.accumulate` in the class, or inherit from h2o_mini.H2O)")

    def __post_init__(self):
        hints = typing.get_type_hints(type(self))
        for f in fields(self):
            object.__setattr__(self, f.name, check_param(type(self).__name__, f, hints.get(f.name),
                                                         getattr(self, f.name)))
        if self.capacity is not None and self.capacity < 1:
            raise UserError(f"{self}: the capacity C must be at least one token")
        self.__dict__.pop("_checked_keep_score", None)  # a checked plugin (guard.py): its first real call is checked too

    @property
    def capacity(self) -> int | None:
        raise NotImplementedError

    def layer_capacity(self, layer: int, n_layer: int, length: int) -> int:
        """Slots in layer `layer` for a sequence of `length` tokens: C in every layer, at most `length`."""
        return min(self.capacity or length, length)

    def for_model(self, cfg) -> "Policy":
        """The policy for the model `cfg` (`config.Config`) that the cache is built for: a rule fitted to one model
        (`learned`) refuses another here, in one line. Called once, before `for_layer`."""
        return self

    def for_layer(self, layer: int, n_layer: int) -> "Policy":
        """The policy layer `layer` runs (a per-layer rule returns a copy with its own parameters)."""
        return self

    @property
    def prompt_window(self) -> int | None:
        """Dense prefill: how many of the last prompt queries shape the scores (None: all of them)."""
        return None

    def keep_score(self, score: torch.Tensor, pos: torch.Tensor, t: torch.Tensor, keys: torch.Tensor | None = None,
                   values: torch.Tensor | None = None, state: torch.Tensor | None = None) -> torch.Tensor:
        """score, pos: (B, H, S) the slots' fp32 scores and original positions (< 0: no token there); t: the
        arriving position, broadcastable to them; keys, values: (B, H, S, hd) as attention reads them; state:
        the rule's own (B, H, g, n), None for a rule that keeps none (`state_size`). Returns (B, H, S): higher
        keeps, +inf protects. Pure tensor code (it runs inside the compiled step)."""
        raise NotImplementedError

    def state_size(self, head_dim: int) -> int:
        """How many fp32 numbers the rule keeps per (row, query head) beside the tokens' scores, held by the cache
        as `state` (B, H, g, n): running statistics of the queries (Expected Attention's mean and covariance).
        0 (the default): no state, `observe` never runs and `keep_score` gets None."""
        return 0

    def observe(self, state: torch.Tensor, queries: torch.Tensor, t: torch.Tensor, rope) -> torch.Tensor:
        """Step 0, once per real token, before it evicts: state (B, H, g, n); queries (B, H, g, hd), this token's
        query heads grouped by KV head, as attention reads them (after RoPE at t); t: (B, 1, 1) its position;
        rope: the layer's `model.Rope` (None for a model without RoPE). Returns the new state."""
        return state

    def observe_many(self, state: torch.Tensor, queries: torch.Tensor, pos: torch.Tensor, rope) -> torch.Tensor:
        """Q tokens in order (a dense prompt, the start of a stream chunk): queries (B, H, g, Q, hd); pos (B, Q),
        < 0 padding, which is not observed. `observe` once per token unless a rule has a closed form."""
        for i in range(queries.shape[3]):
            t = pos[:, i, None, None, None]  # (B, 1, 1, 1)
            state = torch.where(t >= 0, self.observe(state, queries[:, :, :, i], t[..., 0], rope), state)
        return state

    def insert_score(self, keys: torch.Tensor) -> torch.Tensor:
        return keys.new_zeros(keys.shape[:-1], dtype=torch.float32)

    def update(self, score: torch.Tensor, p: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """One query, for a rule that reads attention (`needs_scores`): score (B, H, S); p (B, H, S) its attention,
        summed over the GQA group (0 where it did not attend); attended: the slots it attended. The new scores."""
        raise NotImplementedError

    def accumulate(self, score: torch.Tensor, probs: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Q queries in order, (B, H, Q, S): `update` once per query that attended something (a query that does
        not count, such as padding or one before SnapKV's window, leaves the scores alone). A rule may write a
        closed form (H2O: one sum)."""
        for i in range(probs.shape[2]):
            counts = attended[:, :, i].any(-1, keepdim=True)  # (B, H, 1)
            score = torch.where(counts, self.update(score, probs[:, :, i], attended[:, :, i]), score)
        return score

    def prompt_score(self, score: torch.Tensor) -> torch.Tensor:
        """Dense prefill: the prompt tokens' scores (B, H, T) once every prompt query is in."""
        return score

    @classmethod
    def from_budget(cls, capacity: int, recent: int | None) -> "Policy":
        """The policy for a cache of `capacity` tokens. The default fits a simple rule: its one required field
        (`keep`, say) is C; or, beside a required `recent`, the other one is C - recent, recent being half of C
        (rounded up) unless --recent gives it. Any other rule writes its own."""
        required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
        if not required:  # a rule with no size (full)
            return cls()
        if len(required) == 1:
            return cls(**{required[0]: capacity})
        if len(required) == 2 and "recent" in required:
            recent = capacity - capacity // 2 if recent is None else recent
            other = required[1 - required.index("recent")]
            return cls(**{other: capacity - recent, "recent": recent})
        raise NotImplementedError(f"{cls.__name__} has no from_budget: its required fields {required} are not one "
                                  "size, nor a size and `recent`")

    def params(self) -> dict:
        """Every parameter by name: what JSON outputs and sweep rows record."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def keeps_all_of(policy: Policy, length: int) -> bool:
    """Whether the policy keeps every token of a sequence of `length` (its C, the mean over layers, covers it).
    Such a row is run alone, not batched with others (`Rows`): its slots would widen every row's."""
    return (policy.capacity or length) >= length


def check_signature(cls: type) -> None:
    """A rule written for an older protocol (keep_score without `values` or `state`) gets one line saying what changed."""
    params = inspect.signature(cls.keep_score).parameters
    if not {"values", "state"} <= set(params) and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        raise UserError(f"{cls.__name__}.keep_score must take (self, score, pos, t, keys=None, values=None, "
                        "state=None): every rule gets the cached keys and values, and its own state (None for a "
                        "rule without one), in one signature")


def refuse_lookahead(policy: Policy) -> None:
    """Refuses a policy that reads the text ahead (hindsight) wherever tokens are taken one at a time."""
    if policy.lookahead:
        raise UserError(f"policy {policy.name!r} reads the text ahead (it keeps what future queries will attend), "
                        "so only 'eval ppl' and 'eval sweep ppl' can run it")


def check_param(owner: str, f, kind, value):
    """A parameter's value checked against its annotation (int, float, bool or str) and declared range."""
    if kind not in TYPES:
        raise UserError(f"{owner}: parameter {f.name} must be annotated int, float, bool or str (got {kind!r})")
    lo, hi = f.metadata.get("lo", 0 if kind is int else None), f.metadata.get("hi")
    where = " in [" + ("-inf" if lo is None else f"{lo}") + ", " + ("inf" if hi is None else f"{hi}") + "]"
    if kind is str:  # a file the rule reads (a learned rule's weights): a name, checked by the rule itself
        if not isinstance(value, str) or not value or "," in value:
            raise UserError(f"{owner}: {f.name}={value!r} must be a non-empty text without commas")
        return value
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
