"""Eviction policies. `REGISTRY` is the one place a policy is named; the tests iterate over it."""
from __future__ import annotations

from .base import BUDGET_HELP, Policy, capacity_for, describe, parse_budget, recent_for
from .full import Full
from .h2o import H2O
from .heavy_hitter import HeavyHitter
from .keydiff import KeyDiff
from .knorm import KNorm
from .local import Local
from .pyramidkv import PyramidKV
from .scissorhands import Scissorhands
from .sinks import Sinks
from .snapkv import SnapKV
from .tova import TOVA
from ..errors import UserError

REGISTRY: dict[str, type[Policy]] = {cls.name: cls for cls in (
    Full, Local, HeavyHitter, H2O, Sinks, TOVA, Scissorhands, SnapKV, PyramidKV, KNorm, KeyDiff)}


def make_policy(name: str, budget: str | float | int | None, length: int,
                recent: str | float | int | None = None) -> Policy:
    """A policy from CLI-style arguments: `budget` is a fraction of `length` or a token count (see the spec)."""
    if name not in REGISTRY:
        raise UserError(f"unknown policy {name!r} (choose from {', '.join(REGISTRY)})")
    cls = REGISTRY[name]
    if recent is not None and not cls.takes_recent:
        with_recent = ", ".join(n for n, c in REGISTRY.items() if c.takes_recent)
        raise UserError(f"--recent does not apply to policy {name!r} (only to {with_recent})")
    if name == "full":
        if budget is not None:
            raise UserError("policy 'full' keeps every token: --budget does not apply to it")
        return Full()
    if budget is None:
        raise UserError(f"policy {name!r} needs --budget")
    capacity = capacity_for(parse_budget(budget), length)
    return cls.from_budget(capacity, recent_for(recent, capacity))


def recent_if_taken(name: str, recent):
    """`--recent` for a policy that splits C by it, else None: one --recent given to several policies
    (bench, sweeps, plots) reaches only those it means something to."""
    return recent if REGISTRY[name].takes_recent else None


__all__ = ["recent_if_taken", "BUDGET_HELP", "describe", "Policy", "REGISTRY", "make_policy", "Full", "Local",
           "HeavyHitter", "H2O", "Sinks", "TOVA", "Scissorhands", "SnapKV", "PyramidKV", "KNorm", "KeyDiff"]
