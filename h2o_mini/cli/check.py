"""`h2o-mini check-policy SPEC`: parse, run `checkkit.check_policy`, print the table; exit 1 on any failure."""
from __future__ import annotations

import importlib.util
import json
import sys

import click

from ..errors import UserError
from ..policies.guard import PolicyFault
from ..policies import budget_if_taken, make_policy
from .options import Budget, PolicyType, RECENT_HELP


@click.command(name="check-policy", short_help="Prove a policy exact on every code path (built-in or yours).",
               epilog="""\b
Examples:
  h2o-mini check-policy h2o
  h2o-mini check-policy a2sf:gamma=0.9
  h2o-mini check-policy path/to/my_policy.py:MyPolicy --budget 12
  h2o-mini check-policy my_package.rules:MyPolicy --families llama_gqa --json
""")
@click.argument("spec", type=PolicyType())
@click.option("--budget", default="10", show_default=True, type=Budget(),
              help="C over the kit's 40-token texts (a token count, or a fraction of 40)")
@click.option("--recent", default=None, type=Budget("--recent"), help=RECENT_HELP)
@click.option("--families", default="llama_gqa,opt,neox,qwen3,hybrid,gemma", show_default=True,
              help="comma-separated tiny families (the compiled and quantized paths run on the first)")
@click.option("--transformers/--no-transformers", default=None, help="also run the policy inside transformers' own "
              "models (tiny LLaMA and Gemma 3; default: when transformers is installed, 'h2o-mini[hf]')")
@click.option("--json", "as_json", is_flag=True, help="one JSON object per checked path")
def check_policy(spec, budget, recent, families, transformers, as_json):
    """Run SPEC through every fast path of the cache (decode step, stream chunks, dense prefill in one and in
    several query blocks, ragged batches in both prefill modes, the compiled step, 8- and 4-bit keys and values)
    on tiny random decoders of six families (two with a sliding-window layer, one Gemma-shaped), and compare each with a naive
    reference that applies the policy's own hooks one token at a time, every key and value kept, eviction as a
    mask. Also checks that a closed-form `accumulate` equals `update` applied query by query. Prints the largest
    logit difference of each path (passes at <= 1e-4); exits 1 if any path fails, or if a hook breaks the
    protocol (it raises, returns NaN, a wrong shape or dtype, or changes its inputs: docs/spec.md, "Faults").
    Where transformers is installed, the same rule also runs inside transformers' own tiny LLaMA and Gemma 3 models
    through h2o_mini.transformers_cache (decode, stream and dense paths) against the same reference."""
    from ..checks.checkkit import FAMILIES, TOL, check_policy as run_checks
    installed = importlib.util.find_spec("transformers") is not None
    if transformers and not installed:
        raise UserError("--transformers needs transformers (pip install 'h2o-mini[hf]')")
    transformers = installed if transformers is None else transformers
    chosen = [f.strip() for f in families.split(",") if f.strip()]
    unknown = [f for f in chosen if f not in FAMILIES]
    if unknown or not chosen:
        raise UserError(f"--families: unknown {', '.join(unknown) or '(none given)'} (choose from {', '.join(FAMILIES)})")
    def make(length: int):
        return make_policy(spec, budget_if_taken(spec, budget), length, recent)
    try:
        made = make(40)  # a bad budget or parameter fails here, before any check runs
    except PolicyFault:  # a hook that breaks the protocol: reported below as a failed check
        made = spec
    if not as_json:
        click.echo(f"checking {spec} ({made}) against the naive reference; tolerance {TOL:g}")
        click.echo(f"{'family':<12} {'path':<44} {'max |diff|':>11}  result")

    def show(row):
        if as_json:
            click.echo(json.dumps(row))
        else:
            ok = "pass" if row["max_diff"] <= TOL else "FAIL" + (f": {row['fault']}" if "fault" in row else "")
            click.echo(f"{row['family']:<12} {row['path']:<44} {row['max_diff']:>11.2e}  {ok}")
    rows = run_checks(make, chosen, progress=lambda row: show(dict(row, passed=row["max_diff"] <= TOL)),
                      transformers=transformers)
    if rows[0]["path"].startswith("accumulate"):
        show(rows[0])  # the closed-form check, computed first, shown last
    failed = [r for r in rows if not r["passed"]]
    if not as_json:
        click.echo(f"{len(rows) - len(failed)} passed, {len(failed)} failed")
    if failed:
        sys.exit(1)
