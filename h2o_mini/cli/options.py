"""The options the `h2o-mini` commands share, and the click types that check values as they are parsed:
a wrong value is a one-line usage error before any model is loaded."""
from __future__ import annotations

import importlib.util
import math

import click

from ..errors import UserError
from ..files import check_output
from ..policies import BUDGET_HELP, parse_budget, resolve, takes_recent_names

COUNT = 2**31  # the largest count any option takes (tokens, steps)
IMAGE = (".png", ".pdf", ".svg")


def check_image(path) -> None:
    """A picture to write, checked before any work: its name, and matplotlib itself (else everything would be
    computed first, then lost)."""
    check_output(path, IMAGE)
    if importlib.util.find_spec("matplotlib") is None:
        raise UserError(f"{path}: drawing needs matplotlib: pip install 'h2o-mini[plot]'")


def check_installed(module: str, what: str, extra: str) -> None:
    """An optional dependency that an option needs, checked before any work."""
    if importlib.util.find_spec(module) is None:
        raise UserError(f"{what} needs {module} (pip install 'h2o-mini[{extra}]')")


class Finite(click.FloatRange):
    """A float in a range that is also finite (click's FloatRange lets NaN through every bound)."""

    def convert(self, value, param, ctx):
        value = super().convert(value, param, ctx)
        if not math.isfinite(value):
            self.fail(f"{value} is not a finite number", param, ctx)
        return value


class Budget(click.ParamType):
    """A budget as the spec reads it, checked at parse time; kept as the text ('1' and '1.0' differ)."""

    name = "budget"

    def __init__(self, what: str = "budget"):
        self.what = what

    def convert(self, value, param, ctx):
        if self.what == "--recent" and str(value).strip() in ("0", "0.0"):
            return value
        parse_budget(value, self.what)
        return value


class PolicyType(click.ParamType):
    """A `--policy` spec (`h2o`, `a2sf:gamma=0.9`, `path/to/file.py:Class`, `pkg.mod:Class`, an installed name),
    resolved at parse time so that a bad one fails before any model is loaded; kept as its text."""

    name = "policy"

    def convert(self, value, param, ctx):
        resolve(value)  # a bad spec is a UserError: one line, exit 2 (a plugin's own traceback: --debug)
        return str(value).strip()


POLICY_HELP = ("a name from 'h2o-mini policies', path/to/file.py:Class or package.module:Class, each optionally "
               "with parameters: h2o:heavy=8,recent=24")


class ListOf(click.ParamType):
    """A comma-separated list ('0.1,0.5,0.9'), each item converted by `kind` (int, float or str) at parse time."""

    name = "list"

    def __init__(self, kind=float):
        self.kind = kind

    def convert(self, value, param, ctx):
        if isinstance(value, list):
            return value
        try:
            items = [self.kind(x.strip()) for x in str(value).split(",") if x.strip()]
        except ValueError:
            self.fail(f"{value!r} is not a comma-separated list of {self.kind.__name__} values", param, ctx)
        if not items:
            self.fail("the list is empty", param, ctx)
        return items


def model_options(f):
    f = click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N")(f)
    f = click.option("--dtype", default="float32", show_default=True, help="float32, bfloat16 or float16")(f)
    f = click.option("--model", default="default", show_default=True,
                     help="a Hugging Face checkpoint folder, or a model prepared offline by name: 'default' "
                          "(SmolLM2-135M-Instruct), 'gemma3-270m' (Gemma 3 270M base)")(f)
    return f


def engine_option(f):
    return click.option("--engine", default="h2o-mini", show_default=True, type=click.Choice(["h2o-mini", "transformers"]),
                        help="what computes the model: h2o-mini's decoder, or transformers' AutoModelForCausalLM "
                        "with the same evicting cache inside (needs 'h2o-mini[hf]'; docs/transformers.md)")(f)


def kv_bits_option(f):
    return click.option("--kv-bits", default=None, type=click.Choice(["8", "4"]), callback=lambda c, p, v: v and int(v),
                        help="store keys and values as 8- or 4-bit integers (per-token groups of 32 channels, fp16 "
                        "scale and zero; default: the model's dtype)")(f)


RECENT_HELP = (f"the protected recent share of C, for {', '.join(takes_recent_names())} (and plugins that take it; "
               "snapkv/pyramidkv: their observation window): a fraction of C or a token count (default: each policy's "
               "own, see 'h2o-mini policies')")


def policy_options(f):
    f = click.option("--recent", default=None, type=Budget("--recent"), help=RECENT_HELP)(f)
    f = click.option("--budget", default=None, type=Budget(), help=f"KV budget C: {BUDGET_HELP}")(f)
    f = click.option("--policy", default="full", show_default=True, type=PolicyType(), help=POLICY_HELP)(f)
    return f


def sampling_options(seed: int | None = None, seed_help: str | None = None):
    """--temperature, --top-k, --top-p and --seed, as `generate` and `eval generate` both take them."""
    def apply(f):
        f = click.option("--seed", default=seed, show_default=seed is not None, type=click.IntRange(0, 2**63 - 1),
                         help=seed_help)(f)
        f = click.option("--top-p", default=1.0, show_default=True, type=Finite(0, 1, min_open=True),
                         help="1 = off")(f)
        f = click.option("--top-k", default=0, show_default=True, type=click.IntRange(0, COUNT), help="0 = off")(f)
        return click.option("--temperature", default=0.0, show_default=True, type=Finite(min=0),
                            help="0 = greedy")(f)
    return apply
