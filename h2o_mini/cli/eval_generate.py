"""`h2o-mini eval generate`: what each policy does to long generations (evals/generation.py). Parse, run the
points through the sweep machinery (`cli/eval_sweep.py`: resumable --out, --json, a table, --plot)."""
from __future__ import annotations

from pathlib import Path

import click

from ..api import encode_prompts
from ..evals.generation import BUILTIN, Prompts, check_room, evaluate_many, policy_for
from ..evals.sweep import points
from ..files import read_prompts
from ..generate import Sampling
from ..policies import recent_if_taken, resolve
from ..policies.guard import PolicyFault
from ..policies.base import refuse_lookahead
from ..views.plot import save_generation_plot
from .eval import repeatable_policies
from .options import COUNT, model_options, sampling_options
from .eval_sweep import _sweep, check_plot, load_for_points, settings

# two measures of the policy's own text against full's: how far it follows before the first difference, and how
# many of its tokens equal full's at the same place in all
HEADER = (f"{'policy':<14}{'budget':>8}{'nll':>9}{'kl_full':>9}{'tokens before first diff':>26}"
          f"{'same token, share':>19}{'KV MiB':>9}")


def row_line(row: dict) -> str:
    return (f"{row['policy']:<14}{row['budget'] or 'all':>8}{row['nll']:>9.4f}{row['kl_full']:>9.4f}"
            f"{row['agree_tokens']:>26.1f}{100 * row['agree_share']:>18.1f}%{row['kv_bytes'] / 2**20:>9.2f}")


def table(results: dict) -> str:
    """One line per point, then how much full's text repeats itself (a loop is easy to keep: evaluation.md)."""
    rows = [r[0] for r in results.values()]
    lines = [HEADER] + [row_line(row) for row in rows]
    known = [row for row in rows if "ref_repeated" in row]  # rows written before the field have none
    if known:
        each = ", ".join(f"{100 * p['ref_repeated']:.0f}%" for p in known[0]["per_prompt"])
        lines.append(f"full's text: {100 * known[0]['ref_repeated']:.0f}% of its 4-grams repeat an earlier one "
                     f"(per prompt: {each}); a prompt whose text loops says little about a policy")
    return "\n".join(lines)


@click.command(name="generate", short_help="What each policy does to long generations.", epilog="""\b
Examples:
  h2o-mini eval generate --max-new-tokens 64 --policy h2o --policy local --budget 64
  h2o-mini eval generate --prompts-file prompts.txt --max-new-tokens 128 --policy h2o --budget 0.2 --json
  h2o-mini eval generate --max-new-tokens 64 --policy h2o --policy tova --budget 32 --budget 64 \\
      --out gen.jsonl --plot gen.png
  h2o-mini eval generate --max-new-tokens 64 --temperature 0.8 --seed 1 --policy h2o --budget 48
""")
@model_options
@repeatable_policies
@click.option("--prompts-file", default=None, help="one prompt a line (default: the built-in long-output set)")
@click.option("--max-new-tokens", default=512, show_default=True, type=click.IntRange(1, COUNT),
              help="N: the reference's length, and the policy's")
@click.option("--prefill", default="dense", show_default=True, type=click.Choice(["dense", "stream"]))
@sampling_options(seed=0, seed_help="with a --temperature: the seed of the draws full and every policy share")
@click.option("--chat/--no-chat", default=None, help="the chat template (default: when the model has one)")
@click.option("--out", default=None, help="a .jsonl file: each finished point is appended; a rerun skips it")
@click.option("--plot", "plot_path", default=None, help="divergence and NLL against budget (.png/.pdf/.svg)")
@click.option("--max-batch", default=32, show_default=True, type=click.IntRange(1, 4096),
              help="at most N rows (a point is one row per prompt) in one batched pass; memory grows with N")
@click.option("--json", "as_json", is_flag=True, help="one JSON line per policy and budget")
def eval_generate(model, dtype, device, policies, budgets, recent, kv_bits, prompts_file, max_new_tokens, prefill,
                  temperature, top_k, top_p, seed, chat, out, plot_path, max_batch, as_json):
    """The full cache writes N tokens for each prompt (the reference); then, for every --policy and --budget:
    the NLL of the reference read back through the policy's cache and the KL to full along it (teacher-forced),
    how many of the policy's own N tokens equal the reference before the first difference and in all
    (free-running), and the cache's bytes. A fractional --budget is taken of each
    prompt + N. `full` is always one point. The points run as the rows of batched passes (--max-batch), each row
    its own policy and capacity. Every text is greedy, or, with a --temperature, sampled: token i of a prompt
    is drawn with the same random numbers under full and under every policy (coupled by --seed), since small
    models loop when greedy."""
    check_plot(plot_path, budgets)
    for spec in policies or ():  # before the model and the reference: hindsight reads ahead, no text can
        refuse_lookahead(resolve(spec).cls)
    sampling = Sampling(temperature, top_k, top_p)
    sampled = {"sampling": {**vars(sampling), "seed": seed}} if temperature > 0 else {}  # greedy rows: as before
    if prompts_file:
        prompts = Prompts(Path(prompts_file).name, read_prompts(prompts_file))
    else:
        prompts = Prompts("builtin", list(BUILTIN))
    lm, ranks = load_for_points(model, dtype, device)
    ids = encode_prompts(lm, prompts.texts, chat)
    check_room(lm, ids, max_new_tokens)  # the whole run's settings, refused before any point runs
    for spec, budget in points(policies or ("h2o",), budgets or ("0.2",)):  # a refused setting: one line, now
        for row in ids:
            try:
                policy_for(spec, budget, len(row) + max_new_tokens, recent_if_taken(spec, recent))
            except PolicyFault:  # a plugin's fault fails its own point only, when it runs
                pass
    setup = settings(lm, dtype, kv_bits, recent, "\n".join(prompts.texts), new_tokens=max_new_tokens,
                     prefill=prefill, chat=chat, **sampled)
    title = f"{lm.folder.name}: {prompts.name} prompts, {max_new_tokens} new tokens" + (
        f", sampled at temperature {temperature:g} (seed {seed})" if sampled else "")

    def run_points(todo):  # the points not in --out yet, as the rows of batched passes
        for i, row in evaluate_many(lm, prompts, max_new_tokens, todo, recent, prefill, chat, kv_bits, max_batch,
                                    sampling=sampling, seed=seed):
            yield todo[i], [row]
    _sweep("generate", policies or ("h2o",), budgets or ("0.2",), out, plot_path, as_json, title, run_points, setup,
           show=table,
           draw=lambda results, path, title: save_generation_plot([rows[0] for rows in results.values()], path, title),
           ranks=ranks)
