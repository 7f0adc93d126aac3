"""Eviction policies. `REGISTRY` is the one place a policy is named; the tests iterate over it."""
from __future__ import annotations

from dataclasses import replace

from .base import BUDGET_HELP, Policy, capacity_for, describe, param, parse_budget, recent_for
from .a2sf import A2SF
from .expected_attention import ExpectedAttention
from .full import Full
from .h2o import H2O
from .heavy_hitter import HeavyHitter
from .hindsight import Hindsight
from .keydiff import KeyDiff
from .learned import Learned
from .knorm import KNorm
from .local import Local
from .paged_h2o import PagedH2O
from .pyramidkv import PyramidKV
from .rkv import RKV
from .scissorhands import Scissorhands
from .sinks import Sinks
from .snapkv import SnapKV
from .tova import TOVA
from .vatp import VATP
from .plugins import PluginError, Spec, parse_spec
from ..errors import UserError, note

REGISTRY: dict[str, type[Policy]] = {cls.name: cls for cls in (
    Full, Local, HeavyHitter, H2O, Sinks, TOVA, Scissorhands, SnapKV, PyramidKV, KNorm, KeyDiff, A2SF, VATP, PagedH2O,
    RKV, ExpectedAttention)}
# Policies that read the text ahead: `--policy` knows them, only `eval ppl` / `eval sweep ppl` run them, and the
# registry's conformance kit (which runs every policy causally) does not iterate over them.
LOOKAHEAD: dict[str, type[Policy]] = {Hindsight.name: Hindsight}
# Policies fitted to one model (a weights file from `h2o-mini learn-policy`): `--policy` knows them; the registry's
# kit, which makes every policy for tiny models, does not iterate over them (tests/test_learned.py checks them).
FITTED: dict[str, type[Policy]] = {Learned.name: Learned}


def resolve(spec: "str | Spec") -> Spec:
    """A `--policy` value (`h2o`, `a2sf:gamma=0.9`, `my.py:MyRule`, an installed name) resolved to its class."""
    return spec if isinstance(spec, Spec) else parse_spec(spec, {**REGISTRY, **LOOKAHEAD, **FITTED})


def make_policy(spec: "str | Spec", budget: str | float | int | None, length: int,
                recent: str | float | int | None = None, quiet: bool = False) -> Policy:
    """A policy from CLI-style arguments: `spec` as `--policy` reads it (`plugins.py`), `budget` a fraction of
    `length` or a token count (see the spec). Parameters given in the spec set the fields `from_budget` leaves to
    them (a2sf's gamma);
    if they change C, the budget is refused in one line rather than silently overridden, and with no budget they
    may define the policy alone (`h2o:heavy=8,recent=24`). A fraction so small that C rounds up to one token says
    so on stderr (unless `quiet`: callers that make one policy per request say it once themselves)."""
    spec = resolve(spec)
    cls = spec.cls
    if recent is not None and not cls.takes_recent:
        raise UserError(f"--recent does not apply to policy {spec.name!r} (only to "
                        f"{', '.join(takes_recent_names())}, and plugins that set takes_recent)")
    if not cls.takes_budget:
        if budget is not None:
            raise UserError(f"policy {spec.name!r} keeps every token: --budget does not apply to it")
        return cls(**dict(spec.given))
    if budget is None:
        if spec.given and recent is None:
            try:  # the parameters alone, if they are every field the policy needs
                return cls(**dict(spec.given))
            except TypeError:
                pass
        raise UserError(f"policy {spec.name!r} needs --budget (or every parameter of its size in --policy "
                        f"{spec.name}:...)")
    share = parse_budget(budget)
    capacity = capacity_for(share, length)
    if isinstance(share, float) and share * length < 0.5 and not quiet:
        note(f"h2o-mini: note: --budget {budget} of {length} tokens rounds to less than one token: C = 1")
    policy = cls.from_budget(capacity, recent_for(recent, capacity))
    if not spec.given:
        return policy
    given = replace(policy, **dict(spec.given))
    if given.capacity is not None and min(given.capacity, length) != min(capacity, length):
        raise UserError(f"--policy {spec.text} --budget {budget}: the parameters make C = {given.capacity}, the budget "
                        f"C = {capacity} of {length} tokens; give the split with --recent and the size with --budget, "
                        "or leave --budget out to take the parameters alone")
    return given


def recent_if_taken(spec, recent):
    """`--recent` for a policy that splits C by it, else None: one --recent given to several policies
    (bench, sweeps, plots) reaches only those it means something to."""
    return recent if resolve(spec).cls.takes_recent else None


def budget_if_taken(spec, budget):
    """`--budget` for a policy that takes one, else None: one --budget given to several policies reaches only
    those that evict (`full` keeps everything)."""
    return budget if resolve(spec).cls.takes_budget else None


def takes_recent_names() -> list[str]:
    """The registered policies that --recent applies to (help texts are built from this)."""
    return [name for name, cls in REGISTRY.items() if cls.takes_recent]


__all__ = ["recent_if_taken", "budget_if_taken", "BUDGET_HELP", "describe", "Policy", "REGISTRY", "make_policy",
           "resolve", "Spec", "PluginError", "param", "Full", "Local", "HeavyHitter", "H2O", "Sinks", "TOVA",
           "Scissorhands", "SnapKV", "PyramidKV", "KNorm", "KeyDiff", "A2SF", "VATP", "PagedH2O", "RKV",
           "Hindsight", "LOOKAHEAD", "ExpectedAttention", "Learned", "FITTED"]
