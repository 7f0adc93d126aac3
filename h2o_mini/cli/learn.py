"""`h2o-mini learn-policy`: fit the `learned` rule to the hindsight reference on one text (`evals/learn.py`)."""
from __future__ import annotations

import json
from pathlib import Path

import click

from .. import api
from ..files import check_output, read_text
from ..policies.learned import FEATURES
from .options import Finite, model_options


@click.command(name="learn-policy", short_help="Fit a keep-score to the hindsight reference on a text.", epilog="""\b
Example:
  h2o-mini learn-policy --text /usr/share/common-licenses/Apache-2.0 --tokens 512 --budget 0.1 --out rule.safetensors
  h2o-mini eval ppl --text /usr/share/common-licenses/GPL-3 --tokens 512 --policy learned:weights=rule.safetensors --budget 0.1
""")
@model_options
@click.option("--text", "text_path", required=True, help="the text to fit on (a file, or - for standard input)")
@click.option("--tokens", default=2048, show_default=True, type=click.IntRange(64, 65536))
@click.option("--budget", default=0.1, show_default=True, type=Finite(0, 1, min_open=True),
              help="the fraction of --tokens a cache keeps: the choices the fit learns to make")
@click.option("--samples", default=48, show_default=True, type=click.IntRange(1, 4096),
              help="positions per layer where the choice is fitted")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, 2**63 - 1))
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="a .safetensors file")
@click.option("--json", "as_json", is_flag=True, help="print what was fitted as one JSON object")
def learn_policy(model, dtype, device, text_path, tokens, budget, samples, seed, out, as_json):
    """One full pass over the text (nothing evicted) records every layer's queries, keys and values; at --samples
    positions per layer, a cache of --budget x --tokens tokens would choose among its candidates, and the rule learns
    (least squares, per layer) to rank them as hindsight does, by the attention still to come, from features the
    cache has causally: attention received, age, key and value norms, Expected Attention's prediction, the
    arriving query's logit. Writes the weights with the model they belong to; `--policy learned:weights=FILE`
    runs them (and refuses them on another model). Prints how much each feature moves the ranking."""
    from ..evals.learn import fit, save_rule
    check_output(out, (".safetensors",))
    text = read_text(text_path)
    lm = api.load(model, dtype, device)
    ids = api.scored_ids(lm, text, tokens)
    weights, report = fit(lm.model, ids, budget, samples, seed)
    save_rule(out, weights, report, lm.folder.name, lm.model.cfg, Path(text_path).name, tokens, budget)
    if as_json:
        click.echo(json.dumps({"out": out, "model": lm.folder.name, "text": text_path, "tokens": tokens,
                               "budget": budget, **report}))
        return
    click.echo(f"fitted {lm.model.cfg.n_layer} layers on {tokens} tokens of {text_path} "
               f"(R^2 median {sorted(report['r2'])[len(report['r2']) // 2]:.2f}); weight x spread, mean over layers:")
    for name in FEATURES:
        click.echo(f"  {name:<20} {report['importance'][name]:+.3f}")
    click.echo(out)
