"""`h2o-mini eval sweep ppl|needle|tasks`: the options of that evaluation, with repeatable --policy and
--budget (default: every registered policy x 0.05 0.1 0.2 0.5), --out FILE.jsonl (resumable), a table,
--plot FILE.png. Parse, call `h2o_mini.evals.sweep`, print."""
from __future__ import annotations

import hashlib
import json
from functools import partial
from pathlib import Path

import click

from .. import api, parallel
from ..evals.ppl import perplexities
from ..errors import UserError, note
from ..evals.sweep import (Failed, check_budget_kinds, one_by_one, point_name, points, run_sweep, save_sweep_plot,
                           table)
from ..files import read_text
from ..policies import LOOKAHEAD, REGISTRY, recent_if_taken
from .eval import _harness, needle_options, ppl_options, repeatable_policies, task_result, tasks_options
from .options import check_image, model_options


def sweep_options(f):
    f = click.option("--json", "as_json", is_flag=True, help="one JSON line per row, no progress bar")(f)
    f = click.option("--plot", "plot_path", default=None, help="quality against budget (.png/.pdf/.svg)")(f)
    f = click.option("--out", default=None, help="a .jsonl file: each finished point is appended; a rerun skips "
                     "the points already there")(f)
    return repeatable_policies(model_options(f))


def settings(lm, dtype: str, kv_bits, recent, text: str | None = None, **more) -> dict:
    """Everything besides (policy, budget) that changes a sweep's numbers: a row is reused only when these are
    equal. The text by its SHA-256 (a path could hold another text tomorrow), the model by its folder."""
    out = {"model": str(lm.folder.resolve()), "dtype": dtype, "kv_bits": kv_bits, "recent": recent}
    if text is not None:
        out["text_sha256"] = hashlib.sha256(text.encode("utf-8")).hexdigest()
    return {**out, **more}


def _sweep(kind: str, policies, budgets, out, plot_path, as_json, title: str, run_points, setup: dict,
           show=None, draw=None, ranks=None) -> None:
    """Every point through `run_points` (`evals.sweep.run_sweep`; resumable --out), each row printed with --json
    as its point finishes, then the table (`show`, default the sweep's own) and the plot (`draw`), in the
    sweep's order of points. ranks: under torchrun, the points are split over the ranks (`load_for_points`)."""
    show = show or (lambda results: table(kind, results))
    draw = draw or (lambda results, path, title: save_sweep_plot(kind, results, path, title))
    todo, results, failed = points(policies, budgets), {}, {}
    try:
        for point, rows in run_sweep(kind, todo, run_points, Path(out) if out else None, setup, not as_json, ranks):
            if isinstance(rows, Failed):
                failed[point] = rows.reason
                continue
            results[point] = rows
            if as_json:
                for row in rows:
                    click.echo(json.dumps(dict(row, budget=point[1])))
    except KeyboardInterrupt:
        where = (f"; they are saved in {out}, and a rerun with the same --out resumes from them" if out and results
                 else "; give --out FILE.jsonl to keep finished points across runs" if not out else "")
        note(f"h2o-mini: interrupted after {len(results)} of {len(todo)} points{where}")
        if results and not as_json:
            click.echo(show({point: results[point] for point in todo if point in results}))
        raise
    results = {point: results[point] for point in todo if point in results}
    if not as_json and results:
        click.echo(show(results))
    if plot_path and results:
        draw(results, Path(plot_path), title)
    if failed:
        names = ", ".join(map(point_name, failed))
        raise UserError(f"{len(failed)} of {len(todo)} points failed ({names}; each named above)"
                        + (f": the others are in {out}, and a rerun with it retries only these" if out else ""))


def load_for_points(model, dtype, device):
    """(the model, the ranks): under torchrun (`torchrun --nnodes N --nproc-per-node P -m h2o_mini eval sweep ...`)
    a sweep splits its points over the ranks, each holding the whole model (on its own GPU with --device cuda,
    NCCL; gloo on CPU); in one process, (the model, None)."""
    ranks = parallel.from_env(device)
    return api.load(model, dtype, ranks.device(device) if ranks else device), ranks


def check_plot(plot_path, budgets) -> None:
    """Before any model is loaded: the plot's file name, and one kind of budget on its x axis."""
    if plot_path:
        check_image(plot_path)
        check_budget_kinds(budgets)


@click.group(short_help="Every policy at every budget: one table, one plot.")
def sweep():
    """Every --policy at every --budget (default: all registered policies x 0.05 0.1 0.2 0.5)."""


@sweep.command(name="ppl", short_help="Perplexity and fidelity to full at every point.", epilog="""\b
Example:
  h2o-mini eval sweep ppl --text /usr/share/common-licenses/GPL-3 --tokens 512 --policy local --policy h2o \\
      --budget 0.1 --budget 0.2 --out sweep.jsonl --plot sweep.png
""")
@sweep_options
@partial(ppl_options, sweep=True)
def sweep_ppl(model, dtype, device, policies, budgets, recent, kv_bits, out, plot_path, as_json, text_path, tokens,
              compare_full, chunk, max_batch):
    """eval ppl (with --compare-full always on; full's pass is made once) at every point; by default every
    registered policy and the hindsight reference. The points that evict run up to --max-batch at a time as the
    rows of one pass over the text, each row exactly its point run alone. The table gives each point's share
    of h2o's gap to full and of h2o's gap to hindsight at the same budget, where those points are in the sweep."""
    check_plot(plot_path, budgets)
    text = read_text(text_path)
    lm, ranks = load_for_points(model, dtype, device)
    api.scored_ids(lm, text, tokens)  # the text and --tokens checked before any point runs

    def run_points(todo):  # the points not in --out yet, the evicting ones as rows of batched passes
        for point, result in perplexities(lm, text, tokens, todo, recent, chunk, max_batch, not as_json, kv_bits):
            yield point, [result]
    title = f"{lm.folder.name}: perplexity under eviction, {tokens} tokens of {Path(text_path).name}"
    _sweep("ppl", policies or (*REGISTRY, *LOOKAHEAD), budgets, out, plot_path, as_json, title, run_points,
           settings(lm, dtype, kv_bits, recent, text, tokens=tokens, chunk=chunk), ranks=ranks)


@sweep.command(name="needle", short_help="Needle in a haystack at every point.", epilog="""\b
Example:
  h2o-mini eval sweep needle --lengths 512 --depths 0.5 --policy h2o --policy local --budget 0.2 --budget 0.5
""")
@sweep_options
@needle_options
def sweep_needle(model, dtype, device, policies, budgets, recent, kv_bits, out, plot_path, as_json, text_path,
                 lengths, depths, seeds, prefill, chat):
    """eval needle at every point; a point's score is the share of its cells where the needle was found."""
    from ..evals.needle import run_needle
    check_plot(plot_path, budgets)
    text = read_text(text_path)
    lm, ranks = load_for_points(model, dtype, device)
    title = f"{lm.folder.name}: needle in {Path(text_path).name}, {','.join(map(str, lengths))} tokens"
    _sweep("needle", policies, budgets, out, plot_path, as_json, title, one_by_one(lambda p, b: list(run_needle(
        lm, text, lengths, depths, seeds, [(p, b, recent_if_taken(p, recent))], prefill, chat, progress=False,
        kv_bits=kv_bits))), settings(lm, dtype, kv_bits, recent, text, lengths=lengths, depths=depths, seeds=seeds,
                                    prefill=prefill, chat=chat), ranks=ranks)


@sweep.command(name="tasks", short_help="lm-eval tasks at every point.", epilog="""\b
Example:
  h2o-mini eval sweep tasks --tasks gpl_next_sentence --limit 5 --policy h2o --policy local --budget 32
""")
@sweep_options
@tasks_options
def sweep_tasks(model, dtype, device, policies, budgets, recent, kv_bits, out, plot_path, as_json, tasks,
                include_path, num_fewshot, limit, batch_size, prefill, seed):
    """eval tasks at every point; a point's score is the first task's main metric (acc where it has one)."""
    harness = _harness()
    check_plot(plot_path, budgets)
    lm, ranks = load_for_points(model, dtype, device)
    title = f"{lm.folder.name}: {','.join(tasks)} under eviction"
    include = str(Path(include_path).resolve()) if include_path else None
    _sweep("tasks", policies, budgets, out, plot_path, as_json, title, one_by_one(lambda p, b: [task_result(
        harness.run_tasks(lm, tasks, include_path, num_fewshot, limit, batch_size, p, b, recent_if_taken(p, recent),
                          prefill, progress=False, kv_bits=kv_bits, seed=seed), str(model), p, b)]),
           settings(lm, dtype, kv_bits, recent, tasks=tasks, include_path=include, num_fewshot=num_fewshot,
                    limit=limit, prefill=prefill, seed=list(seed)), ranks=ranks)

