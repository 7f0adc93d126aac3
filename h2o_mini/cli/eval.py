"""`h2o-mini eval ...`: perplexity, lm-eval tasks, needle in a haystack, and sweeps over policies and budgets.
Parse, call `h2o_mini.evals`, print; the work is done there."""
from __future__ import annotations

import json
from pathlib import Path

import click

from .. import api, parallel
from ..evals.ppl import perplexity
from ..evals.bench import DEFAULT_TEXT
from ..errors import UserError
from ..files import check_output, read_text, write_atomic
from ..policies import BUDGET_HELP, recent_if_taken, resolve
from .options import (COUNT, check_image, POLICY_HELP, RECENT_HELP, Budget, ListOf, PolicyType, engine_option,
                      kv_bits_option, model_options)


def repeatable_policies(f, one: str | None = None):
    """--policy, --budget (repeatable), --recent, --kv-bits. one: the command that takes a single policy and
    budget (a second value is refused with a pointer to 'eval sweep', never silently dropped)."""
    many = "repeatable: " if one is None else f"one (to compare several: 'h2o-mini eval sweep {one}'): "
    f = kv_bits_option(f)
    f = click.option("--recent", default=None, type=Budget("--recent"), help=RECENT_HELP)(f)
    f = click.option("--budget", "budgets", multiple=True, type=Budget(), help=many + BUDGET_HELP)(f)
    return click.option("--policy", "policies", multiple=True, type=PolicyType(), help=many + POLICY_HELP +
                        ("" if one is None else " [default: full]"))(f)


def one_policy(command: str):
    return lambda f: repeatable_policies(f, one=command)


def _one(values: tuple, flag: str, command: str):
    """The single value of an option that `eval sweep` repeats: a second one is refused, not dropped."""
    if len(values) > 1:
        raise UserError(f"eval {command} runs one {flag}; give several to 'h2o-mini eval sweep {command}'")
    return values[0] if values else None


def ppl_options(f, sweep: bool = False):
    if sweep:  # rows of many policies share one pass, run eagerly (one compiled loop per policy would not pay)
        f = click.option("--max-batch", type=click.IntRange(1, 4096),
                         help="at most N policy/budget points as the rows of one pass (memory grows with N; default: "
                         "as many as fit in half the free memory at the bytes a row needs, reported as 'memory' "
                         "in the JSON)")(f)
    else:
        f = click.option("--compile/--no-compile", default=None, help="compile the per-token eviction loop (default: "
                         "on for cuda; on CPU a compiled call costs more than the small ops it fuses)")(f)
    f = click.option("--chunk", default=128, show_default=True, type=click.IntRange(1, 65536),
                     help="stream chunk size (exact at any size; a smaller chunk makes the loops of more layers "
                     "run together and their slots narrower: docs/benchmarks.md)")(f)
    f = click.option("--compare-full", is_flag=True, help="also report top1_agree_full and kl_full (same run)")(f)
    f = click.option("--tokens", required=True, type=click.IntRange(2, COUNT), help="score the first N tokens")(f)
    return click.option("--text", "text_path", required=True, help="a UTF-8 text file, or - for standard input")(f)


def lm_eval_seed(ctx, param, value):
    """lm_eval's --seed: one integer for all four seeds, or four (python, numpy, torch, few-shot sampler)."""
    if len(value) == 1:
        value = value * 4
    if len(value) != 4 or any(v < 0 for v in value):
        raise click.BadParameter("give one integer >= 0, or four (python, numpy, torch, few-shot sampler)")
    return tuple(value)


def tasks_options(f):
    f = click.option("--seed", default="0,1234,1234,1234", show_default=True, type=ListOf(int),
                     callback=lm_eval_seed, help="lm_eval's --seed: python, numpy, torch and few-shot sampler seeds "
                     "(one integer sets all four); the few-shot examples depend on the last")(f)
    f = click.option("--prefill", default="dense", show_default=True, type=click.Choice(["dense", "stream"]),
                     help="for generate_until requests (log-likelihoods are always scored in stream mode)")(f)
    f = click.option("--batch-size", default=8, show_default=True, type=click.IntRange(1, 1024))(f)
    f = click.option("--limit", default=None, type=click.IntRange(1, COUNT), help="at most N items per task")(f)
    f = click.option("--num-fewshot", default=None, type=click.IntRange(0, 1000))(f)
    f = click.option("--include-path", default=None, help="a folder of task YAMLs (local data works offline)")(f)
    return click.option("--tasks", required=True, type=ListOf(str),
                        help="comma-separated task names, e.g. gpl_next_sentence")(f)


def needle_options(f):
    f = click.option("--chat/--no-chat", default=None, help="the chat template (default: when it has one)")(f)
    f = click.option("--prefill", default="dense", show_default=True, type=click.Choice(["dense", "stream"]))(f)
    f = click.option("--seeds", default=1, show_default=True, type=click.IntRange(1, 1000),
                     help="needles (numbers) per cell")(f)
    f = click.option("--depths", default="0.1,0.5,0.9", show_default=True, type=ListOf(float),
                     help="where the needle sits, in [0, 1]")(f)
    f = click.option("--lengths", default="1024,2048,4096", show_default=True, type=ListOf(int),
                     help="prompt tokens")(f)
    return click.option("--text", "text_path", default=str(DEFAULT_TEXT), show_default=True,
                        help="real filler text")(f)


@click.group(name="eval", short_help="Measure what a policy costs in quality.")
@click.pass_context
def eval_(ctx):
    """Measure what a policy costs in quality: perplexity, lm-eval tasks, needle in a haystack, long generations,
    sweeps."""
    if ctx.invoked_subcommand and ctx.invoked_subcommand not in ("ppl", "sweep", "generate"):
        parallel.refuse(f"eval {ctx.invoked_subcommand}")


@eval_.command(short_help="Perplexity of a text, every token scored through the evicting cache.", epilog="""\b
Examples:
  h2o-mini eval ppl --text /usr/share/common-licenses/GPL-3 --tokens 1024
  h2o-mini eval ppl --text /usr/share/common-licenses/GPL-3 --tokens 1024 --policy h2o --budget 0.2 --compare-full --json
  h2o-mini eval ppl --text /usr/share/common-licenses/GPL-3 --tokens 1024 --policy hindsight --budget 0.1 --json
""")
@model_options
@one_policy("ppl")
@ppl_options
@engine_option
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def ppl(model, dtype, device, policies, budgets, recent, kv_bits, text_path, tokens, compare_full, chunk, compile,
        engine, as_json):
    """Mean next-token NLL (nats) and perplexity of a text (a file, or - for standard input), every token scored
    in stream mode, under one policy (several: 'eval sweep ppl'). A fractional --budget is taken of --tokens.
    --policy hindsight is the reference that reads the text ahead: what a better choice of as many tokens gives."""
    policy, budget = _one(policies, "--policy", "ppl") or "full", _one(budgets, "--budget", "ppl")
    text = read_text(text_path)
    lm = api.load(model, dtype, device, parallel.from_env(device), engine)
    compile = device.startswith("cuda") and engine == "h2o-mini" if compile is None else compile
    result = perplexity(lm, text, tokens, policy, budget, recent, compare_full, chunk, compile,
                            progress=not as_json, kv_bits=kv_bits)
    if as_json:
        click.echo(json.dumps(result, allow_nan=False))
        return
    line = (f"{result['policy']} C={result['capacity']} tokens={result['tokens']} nll={result['nll']:.4f} "
            f"ppl={result['ppl']:.3f} kv_bytes={result['kv_bytes']} ({result['kv_bits']}-bit) "
            f"({result['seconds']:.1f} s)")
    if compare_full:
        line += f" top1_agree_full={result['top1_agree_full']:.4f} kl_full={result['kl_full']:.4f}"
    click.echo(line)


def _harness():
    try:
        from ..evals import harness
    except ImportError:
        raise UserError("eval tasks needs lm-evaluation-harness: pip install 'h2o-mini[eval]'") from None
    return harness


def task_result(results: dict, model: str, policy: str, budget) -> dict:
    """lm-eval's `results` (keys as lm-eval writes them) with what ran; `score`: the first task's main metric."""
    per_task = results["results"]
    first = next(iter(per_task.values()), {})
    main = next((k for k in ("acc,none", "exact_match,none", "word_perplexity,none") if k in first),
                next((k for k, v in first.items() if isinstance(v, float) and "stderr" not in k), None))
    return {"results": per_task, "policy": policy, "params": dict(resolve(policy).given), "budget": budget,
            "model": model,
            "metric": main, "score": first.get(main), **results["kv"]}


@eval_.command(short_help="lm-evaluation-harness tasks under a policy.", epilog="""\b
Examples:
  h2o-mini eval tasks --tasks gpl_next_sentence --limit 10 --policy h2o --budget 32
  h2o-mini eval tasks --tasks gpl_next_sentence --num-fewshot 2 --limit 10 --json
  h2o-mini eval tasks --tasks my_task --include-path ./my_tasks --policy local --budget 64 --output out.json
""")
@model_options
@one_policy("tasks")
@tasks_options
@click.option("--output", default=None, help="also write the JSON object to this .json file")
@click.option("--log-samples", is_flag=True, help="with --output: also every request and its answer, per task "
              "(lm-eval's samples)")
@engine_option
@click.option("--json", "as_json", is_flag=True, help="print one JSON object (lm-eval's results and the policy)")
def tasks(model, dtype, device, policies, budgets, recent, kv_bits, tasks, include_path, num_fewshot, limit,
          batch_size, prefill, seed, output, log_samples, engine, as_json):
    """Run lm-evaluation-harness tasks (lm_eval.simple_evaluate) with h2o-mini under one policy (several: 'eval
    sweep tasks'). A fractional --budget is taken of each request's own length. The shipped task
    gpl_next_sentence works offline."""
    policy, budget = _one(policies, "--policy", "tasks") or "full", _one(budgets, "--budget", "tasks")
    harness = _harness()
    if output:
        check_output(output, (".json",))
    elif log_samples:
        raise UserError("--log-samples writes the samples into --output FILE.json: give one")
    lm = api.load(model, dtype, device, engine=engine)
    results = harness.run_tasks(lm, tasks, include_path, num_fewshot, limit, batch_size, policy, budget, recent,
                                prefill, log_samples=log_samples, progress=not as_json, kv_bits=kv_bits, seed=seed)
    row = task_result(results, str(model), policy, budget)
    if output:
        saved = dict(row, samples=results["samples"]) if log_samples else row
        write_atomic(output, lambda tmp: tmp.write_text(json.dumps(saved, indent=2, default=str)))
    if as_json:
        click.echo(json.dumps(row, default=str))
    else:
        from lm_eval.utils import make_table
        click.echo(make_table(results))


@eval_.command(short_help="Needle in a haystack under policies and budgets.", epilog="""\b
Examples:
  h2o-mini eval needle --lengths 1024 --depths 0.5 --policy full --policy h2o --budget 0.2
  h2o-mini eval needle --lengths 512 --depths 0.1,0.9 --policy h2o --budget 0.2 --prefill stream --json
  h2o-mini eval needle --lengths 1024 --depths 0.1,0.9 --policy h2o --budget 0.2 --plot needle.png
""")
@model_options
@repeatable_policies
@needle_options
@click.option("--plot", "plot_path", default=None, help="a heat map per policy/budget (.png/.pdf/.svg)")
@click.option("--json", "as_json", is_flag=True, help="one JSON line per cell")
def needle(model, dtype, device, policies, budgets, recent, kv_bits, text_path, lengths, depths, seeds, prefill,
           chat, plot_path, as_json):
    """Plant a random number at a depth of real text, ask for it last, and check the greedy answer."""
    from ..evals.needle import run_needle
    from ..evals.sweep import points
    if plot_path:
        check_image(plot_path)
    pairs = points(policies or ("full",), budgets or ("0.2",), with_full=False)
    todo = [(p, b, recent_if_taken(p, recent)) for p, b in pairs]
    text = read_text(text_path)
    lm = api.load(model, dtype, device)
    cells = []
    for cell in run_needle(lm, text, lengths, depths, seeds, todo, prefill, chat, progress=not as_json,
                           kv_bits=kv_bits):
        cells.append(cell)
        if as_json:
            click.echo(json.dumps(cell))
    if not as_json:
        click.echo(needle_table(cells))
    if plot_path:
        save_needle_plot(cells, plot_path, f"{lm.folder.name}: needle in {Path(text_path).name}")


def needle_table(cells: list[dict]) -> str:
    lines = [f"{'policy':<14}{'budget':>8}{'prefill':>9}{'length':>8}{'depth':>7}  found"]
    groups: dict[tuple, list[bool]] = {}
    for c in cells:
        groups.setdefault((c["policy"], c["budget"], c["prefill"], c["length"], c["depth"]), []).append(c["found"])
    for (p, b, pre, n, d), found in groups.items():
        lines.append(f"{p:<14}{b or 'all':>8}{pre:>9}{n:>8}{d:>7}  {sum(found)}/{len(found)}")
    return "\n".join(lines)


def save_needle_plot(cells: list[dict], out, title: str) -> None:
    from ..views.plot import save_heatmaps
    panels: dict[str, dict] = {}
    for c in cells:
        label = f"{c['policy']}{' ' + c['budget'] if c['budget'] else ''} ({c['prefill']})"
        cell = panels.setdefault(label, {}).setdefault((c["depth"], c["length"]), [])
        cell.append(c["found"])
    shares = {label: {k: sum(v) / len(v) for k, v in grid.items()} for label, grid in panels.items()}
    save_heatmaps(shares, Path(out), title)
