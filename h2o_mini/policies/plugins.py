"""Policies from outside the package, and policy specs with parameters, as `--policy` reads them.

A spec is `REF[:name=value,...]`, where REF is
* a registered name (`h2o`), built in or installed by a package under the entry-point group
  `h2o_mini.policies` (`my_rules = "my_pkg.rules:MyPolicy"` in its pyproject's
  `[project.entry-points."h2o_mini.policies"]`);
* `path/to/file.py:ClassName`: a class in a Python file (imported once per process under a private name);
* `package.module:ClassName`: a class in an importable module.
and the parameters after the last `:` set the policy's dataclass fields by name (`a2sf:gamma=0.9`,
`my.py:VNorm:recent_share=0.25,signed=true`), typed by their annotations.
Anything wrong (no such file, class, or field; not a Policy; the user's module raising on import) is a
`PluginError`: one line, with the user's own traceback kept for `--debug`.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
import typing
from dataclasses import dataclass, fields
from importlib.metadata import entry_points
from pathlib import Path

from ..errors import UserError
from .guard import checked
from .base import Policy, check_param

GROUP = "h2o_mini.policies"


class PluginError(UserError):
    """A policy that could not be loaded; `cause` is the user's exception, shown in full under --debug."""

    def __init__(self, message: str, cause: BaseException | None = None):
        super().__init__(message)
        self.cause = cause


@dataclass(frozen=True)
class Spec:
    """A resolved `--policy` spec: the class, the parameters given, where it came from, and the text."""

    cls: type[Policy]
    given: tuple[tuple[str, object], ...]
    origin: str
    text: str

    @property
    def name(self) -> str:
        return self.cls.name or self.cls.__name__


def installed() -> dict[str, str]:
    """Entry points of the `h2o_mini.policies` group: name -> 'module:Class' (not imported)."""
    return {ep.name: ep.value for ep in entry_points(group=GROUP)}


def _check_class(obj, where: str) -> type[Policy]:
    if not (isinstance(obj, type) and issubclass(obj, Policy)):
        raise PluginError(f"{where} is not an h2o_mini Policy class (subclass h2o_mini.Policy)")
    if obj is Policy:
        raise PluginError(f"{where} is the Policy protocol itself, not a policy")
    return checked(obj)  # code nobody here wrote: each hook's first call is checked (guard.py)


def _from_module(module_name: str, attr: str, where: str) -> type[Policy]:
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            raise PluginError(f"{where}: no module named {e.name!r}", e) from None
        raise PluginError(f"{where}: importing it failed: {type(e).__name__}: {e}", e) from None
    except Exception as e:  # the user's module raised while importing
        raise PluginError(f"{where}: importing it failed: {type(e).__name__}: {e}", e) from None
    if not hasattr(module, attr):
        raise PluginError(f"{where}: module {module_name} has no {attr!r}")
    return _check_class(getattr(module, attr), where)


def _from_file(path: Path, attr: str, where: str) -> type[Policy]:
    path = path.expanduser()
    if not path.is_file():
        raise PluginError(f"{where}: policy file {path} does not exist")
    key = "h2o_mini_plugin_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    if key not in sys.modules:  # once per process: the same class object every time it is named
        spec = importlib.util.spec_from_file_location(key, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module  # dataclasses look their module up while the file runs
        try:
            spec.loader.exec_module(module)
        except BaseException as e:
            del sys.modules[key]
            if isinstance(e, KeyboardInterrupt):
                raise
            raise PluginError(f"{where}: running {path} failed: {type(e).__name__}: {e}", e) from None
    module = sys.modules[key]
    if not hasattr(module, attr):
        raise PluginError(f"{where}: {path} defines no {attr!r}")
    return _check_class(getattr(module, attr), where)


def resolve_class(ref: str, registry: dict[str, type[Policy]]) -> tuple[type[Policy], str]:
    """(class, origin) for a policy reference: a registered or installed name, file.py:Class or module:Class."""
    if ref in registry:
        return registry[ref], "built-in"
    plugins = installed()
    if ref in plugins:
        module, _, attr = plugins[ref].partition(":")
        return _from_module(module, attr, f"installed policy {ref!r} ({plugins[ref]})"), f"entry point {plugins[ref]}"
    if ":" in ref:
        target, _, attr = ref.rpartition(":")
        if target.endswith(".py") or "/" in target or "\\" in target:
            return _from_file(Path(target), attr, f"--policy {ref}"), f"file {target}"
        return _from_module(target, attr, f"--policy {ref}"), f"module {target}"
    known = ", ".join([*registry, *plugins])
    raise PluginError(f"unknown policy {ref!r}: choose from {known}, or give path/to/file.py:ClassName or "
                      "package.module:ClassName")


def parse_value(owner: str, f, kind, text: str):
    """One parameter from its text, by the field's annotation."""
    if kind is bool:
        low = text.strip().lower()
        if low not in ("true", "false", "1", "0", "yes", "no"):
            raise UserError(f"{owner}: {f.name}={text!r} must be true or false")
        value = low in ("true", "1", "yes")
    elif kind is str:
        value = text
    elif kind is int:
        try:
            value = int(text)
        except ValueError:
            raise UserError(f"{owner}: {f.name}={text!r} must be an integer") from None
    else:
        try:
            value = float(text)
        except ValueError:
            raise UserError(f"{owner}: {f.name}={text!r} must be a number") from None
    return check_param(owner, f, kind, value)


def parse_spec(text: str, registry: dict[str, type[Policy]]) -> Spec:
    """A `--policy` value: `REF` or `REF:name=value,...` (see the module docstring)."""
    text = str(text).strip()
    ref, given_text = text, ""
    head, sep, tail = text.rpartition(":")
    if sep and "=" in tail:
        ref, given_text = head, tail
    cls, origin = resolve_class(ref, registry)
    owner = cls.name or cls.__name__
    by_name = {f.name: f for f in fields(cls)}
    hints = typing.get_type_hints(cls)
    given = []
    for item in filter(None, (x.strip() for x in given_text.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in by_name:
            choices = ", ".join(by_name) or "none"
            raise UserError(f"--policy {text}: {owner} has no parameter {key!r} (its parameters: {choices})")
        given.append((key, parse_value(owner, by_name[key], hints.get(key), value.strip())))
    if len({k for k, _ in given}) != len(given):
        raise UserError(f"--policy {text}: a parameter is given twice")
    return Spec(cls, tuple(given), origin, text)
