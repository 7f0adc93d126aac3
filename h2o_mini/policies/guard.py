"""A rule written elsewhere, checked where it is cheap: each hook's first call (docs/spec.md, "Faults").

A plugin's hooks run deep inside the cache's paths. A hook that raises, returns something that is not a tensor,
a tensor of another shape or dtype than the protocol's, NaN where a keep-score or a score is expected, or that
changes its input tensors in place, would otherwise end in a traceback from the cache or, worse, in evictions
that silently differ. `checked(cls)` gives a plugin class a subclass whose hooks check their first call on each
policy object (the inputs cloned and compared afterwards, the answer's type, shape, dtype and NaNs; for a
keep-score, that a full cache leaves some slot unprotected) and then run straight through, so the compiled decode
step pays nothing (a first call inside a compiled graph is not checked there: the eager prompt path comes first,
and `check-policy` runs every hook eagerly). A fault is a `PolicyFault`: one line naming the policy, the hook and
what was wrong.
"""
from __future__ import annotations

import torch

from ..errors import UserError
from .base import Policy

HOOKS = ("keep_score", "insert_score", "update", "accumulate", "prompt_score", "observe", "observe_many")


class PolicyFault(UserError):
    """A policy's hook broke the protocol (docs/spec.md): the message names the policy, the hook and the fault."""


def _tensors(args) -> list[torch.Tensor]:
    return [a for a in args if isinstance(a, torch.Tensor)]


def _expected_shape(hook: str, args) -> torch.Size:
    if hook == "insert_score":
        return args[0].shape[:-1]  # keys (B, H, T, hd) -> (B, H, T)
    return args[0].shape  # the scores' own shape


def check_call(policy, hook: str, fn, args, kwargs=None):
    """Runs `fn(*args, **kwargs)` (the hook) under the protocol's checks; raises a PolicyFault naming what is wrong."""
    who = f"policy {policy.name!r} ({type(policy).__qualname__})"
    kwargs = kwargs or {}
    inputs = _tensors(args) + _tensors(kwargs.values())
    before = [t.clone() for t in inputs]
    try:
        out = fn(*args, **kwargs)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001  the plugin's own error, named in one line
        raise PolicyFault(f"{who}: {hook} raised {type(e).__name__}: {e}") from e
    for t, old in zip(inputs, before):
        if not torch.equal(t, old) and not (t.is_floating_point() and torch.equal(t.isnan(), old.isnan())
                                             and torch.equal(t.nan_to_num(), old.nan_to_num())):
            raise PolicyFault(f"{who}: {hook} changed its input tensors in place (return a new tensor instead)")
    if not isinstance(out, torch.Tensor):
        raise PolicyFault(f"{who}: {hook} returned {type(out).__name__}, not a tensor")
    want = _expected_shape(hook, args)
    if out.shape != want:
        raise PolicyFault(f"{who}: {hook} returned shape {tuple(out.shape)}, not {tuple(want)}")
    if not out.is_floating_point():
        raise PolicyFault(f"{who}: {hook} returned dtype {out.dtype}, not a floating-point tensor")
    if hook != "keep_score" and out.dtype != torch.float32:
        raise PolicyFault(f"{who}: {hook} returned dtype {out.dtype}: scores are float32")
    nan = out.isnan()
    if hook == "keep_score":  # only where a slot holds a token: the others are masked whatever they score
        nan = nan & (args[1] >= 0)
    if bool(nan.any()):
        what = ("a keep-score must be a number (+inf protects a token)" if hook == "keep_score"
                else "a score must be a number")
        raise PolicyFault(f"{who}: {hook} returned NaN for {int(nan.sum())} of {nan.numel()} entries: {what}")
    if hook == "keep_score" and policy.capacity is not None:  # a full cache must have a slot to give up
        live = args[1] >= 0
        full = live.sum(-1) >= policy.capacity
        if bool((full & ((out == torch.inf) | ~live).all(-1)).any()):
            raise PolicyFault(f"{who}: keep_score protects every one of the {policy.capacity} slots of a full cache, "
                              "so the arriving token cannot be placed (+inf protects: leave some slot a number)")
    return out


def _guarded(hook: str, base):
    def hook_fn(self, *args, **kwargs):
        if torch.compiler.is_compiling() or self.__dict__.get("_checked_" + hook):
            return base(self, *args, **kwargs)
        out = check_call(self, hook, lambda *a, **k: base(self, *a, **k), args, kwargs)
        object.__setattr__(self, "_checked_" + hook, True)
        return out
    hook_fn.__name__, hook_fn.__wrapped__ = hook, base
    return hook_fn


def checked(cls):
    """`cls` with every hook it writes checked on its first call on each object (the same name,
    fields and parameters: `dataclasses.replace` and `params()` work as on `cls`)."""
    if "_h2o_mini_checked" in cls.__dict__:  # once per class: the same subclass every time it is named
        return cls.__dict__["_h2o_mini_checked"]
    # only the hooks the plugin writes (or inherits from a class other than the protocol's): the defaults are
    # known to keep the protocol
    body = {hook: _guarded(hook, getattr(cls, hook)) for hook in HOOKS
            if getattr(cls, hook) is not getattr(Policy, hook)}
    body["__qualname__"] = cls.__qualname__
    body["__module__"] = cls.__module__
    body["__doc__"] = cls.__doc__
    sub = type(cls.__name__, (cls,), body)
    type.__setattr__(cls, "_h2o_mini_checked", sub)
    return sub
