"""`h2o-mini explore`: parse, record each policy (`record.py`), write the page (`explore.py`)."""
from __future__ import annotations

from pathlib import Path

import click
import torch
from tqdm import tqdm

from .. import api
from ..evals.bench import DEFAULT_TEXT
from ..errors import UserError, note
from ..files import check_output, read_text, write_atomic
from ..policies import BUDGET_HELP, budget_if_taken, recent_if_taken
from .options import COUNT, POLICY_HELP, RECENT_HELP, Budget, PolicyType, kv_bits_option, model_options


@click.command(short_help="One HTML page of what each policy keeps, step by step, on real text.", epilog="""\b
Examples:
  h2o-mini explore --tokens 512 --policy h2o --policy local --budget 64 --out explore.html
  h2o-mini explore --text /usr/share/common-licenses/GPL-3 --tokens 1024 --policy h2o --policy tova --budget 0.1 --out page.html
  h2o-mini explore "The quick brown fox jumps over the lazy dog." --policy h2o --budget 4 --out fox.html
""")
@click.argument("prompt", required=False)
@model_options
@click.option("--policy", "policies", multiple=True, type=PolicyType(), help="repeatable (default: h2o and local): "
              + POLICY_HELP)
@click.option("--budget", default="0.1", show_default=True, type=Budget(), help=f"C: {BUDGET_HELP} of --tokens")
@click.option("--recent", default=None, type=Budget("--recent"), help=RECENT_HELP)
@click.option("--text", "text_path", default=None, help=f"a UTF-8 text file, or - for standard input (default, "
              f"without PROMPT: {DEFAULT_TEXT})")
@click.option("--tokens", default=512, show_default=True, type=click.IntRange(2, COUNT),
              help="read the first N tokens of the text (all of a PROMPT, at most N)")
@click.option("--prefill", default="stream", show_default=True, type=click.Choice(["stream", "dense"]),
              help="stream: every token through the rule; dense: the text as one prompt, kept set at its end")
@click.option("--snapshots", default=12, show_default=True, type=click.IntRange(1, 256),
              help="steps at which the scores are kept for colouring (the page grows with it)")
@kv_bits_option
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="an .html file in an existing folder")
def explore(prompt, model, dtype, device, policies, budget, recent, text_path, tokens, prefill, snapshots, kv_bits,
            out):
    """Read a text through the real cache under each policy and write one self-contained HTML page (no
    network; opens from file://): the text as its tokens, a step slider, layer and KV-head pickers, two
    policies side by side with their differences marked, and the numbers of the run (C, KV bytes, NLL)."""
    from ..views.explorer import page_data, render
    from ..views.record import record_many
    check_output(out, (".html", ".htm"))
    if prompt is not None and text_path is not None:
        raise UserError("give a PROMPT or --text, not both")
    text = prompt if prompt is not None else read_text(text_path or DEFAULT_TEXT)
    names = policies or ("h2o", "local")
    lm = api.load(model, dtype, device)
    ids = lm.tokenizer.encode(text)
    if prompt is None:
        ids = api.scored_ids(lm, text, tokens)
    elif len(ids) > tokens:
        ids = ids[:tokens]
    if len(ids) < 2:
        raise UserError("the text is shorter than 2 tokens")
    lm.model.cfg.check_length(len(ids), f"{len(ids)} tokens")
    chosen = {}
    for name in names:  # every policy made (and checked) before the first recording
        label = name if name not in chosen else f"{name} #{len(chosen) + 1}"
        chosen[label] = api.as_policy(name, budget_if_taken(name, budget), len(ids), recent_if_taken(name, recent))
    passes = -(-len(chosen) // 32)  # record_many's batches of at most 32 rows
    with tqdm(total=len(ids) * passes if prefill == "stream" else None, desc=f"explore {len(chosen)} policies",
              unit="tok", disable=None, leave=False) as bar:  # streamed: every policy a row of one pass (record.py)
        made = record_many(lm.model, ids, list(chosen.values()), snapshots, kv_bits, prefill, lambda t: bar.update())
    recordings = dict(zip(chosen, made))
    with torch.inference_mode():
        x = torch.tensor([ids], device=next(lm.model.parameters()).device)
        lp = lm.model(x, torch.arange(len(ids), device=x.device)[None])[0, :-1].log_softmax(-1)
        full_nll = -lp.gather(1, x[0, 1:, None]).mean().item()
    source = "the prompt" if prompt is not None else Path(text_path or DEFAULT_TEXT).name
    pieces = [lm.tokenizer.decode([i]) for i in ids]
    data = page_data(lm.folder.name, source, pieces, recordings, budget, full_nll)
    page = render(data)
    write_atomic(out, lambda tmp: tmp.write_text(page, encoding="utf-8"))
    note(f"h2o-mini: wrote {out} ({len(page.encode()) / 1e6:.1f} MB); open it in a browser")
    click.echo(out)
