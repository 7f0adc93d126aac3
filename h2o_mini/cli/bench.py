"""`h2o-mini bench`: parse, call `h2o_mini.evals.bench.run_bench`, print each configuration's row as it finishes,
optionally draw the curves (`--plot`)."""
from __future__ import annotations

import json
from pathlib import Path

import click

from .. import api, parallel
from ..evals.bench import DEFAULT_TEXT, run_bench, table_header, table_row, unfinished_rows
from ..errors import note
from ..files import check_output, read_text, write_atomic
from ..views.plot import save_bench_plot
from ..policies import BUDGET_HELP
from .options import (COUNT, POLICY_HELP, RECENT_HELP, Budget, PolicyType, check_image, check_installed, engine_option,
                      kv_bits_option, model_options)


@click.command(short_help="Speed and memory of policies, side by side in one run.", epilog="""\b
Examples:
  h2o-mini bench --policy full --policy h2o --budget 0.2 --prompt-tokens 512 --new-tokens 32
  h2o-mini bench --policy full --new-tokens 32 --vs-hf            # against transformers generate
  h2o-mini bench --sweep --policy local --policy h2o --budget 0.1 --budget 0.5 --prompt-tokens 256 --new-tokens 16
  h2o-mini bench --kv-memory 32MB --policy full --policy h2o --budget 0.2 --prompt-tokens 512 --new-tokens 32
  h2o-mini bench --policy full --policy h2o --budget 0.2 --prompt-tokens 256 --prompt-tokens 1024 \\
      --prompt-tokens 2048 --batch 4 --new-tokens 16 --same-prompt --plot bench.png   # curves against context
""")
@model_options
@click.option("--policy", "policies", multiple=True, type=PolicyType(), help="repeat to compare several (default: "
              "full): " + POLICY_HELP)
@click.option("--budget", "budgets", multiple=True, type=Budget(), help="repeat to sweep: " + BUDGET_HELP)
@click.option("--recent", default=None, type=Budget("--recent"), help=RECENT_HELP)
@click.option("--batch", "batches", multiple=True, type=click.IntRange(1, 4096), help="repeat for several [default: 1]")
@click.option("--prompt-tokens", multiple=True, type=click.IntRange(1, COUNT),
              help="repeat for a curve against context length [default: 512]")
@click.option("--new-tokens", default=128, show_default=True, type=click.IntRange(2, COUNT))
@click.option("--prefill", default="dense", show_default=True, type=click.Choice(["dense", "stream"]))
@click.option("--text", "text_path", default=str(DEFAULT_TEXT), show_default=True, help="prompts are cut from it")
@click.option("--sweep", is_flag=True, help="every --policy x every --budget in one table (default: the four "
              "policies x budgets 0.1, 0.2, 0.5)")
@click.option("--kv-memory", default=None, help="a KV-cache cap (bytes, or 512MB / 2GiB): each policy runs at the "
              "largest batch whose cache fits")
@click.option("--max-batch", default=256, show_default=True, type=click.IntRange(1, 4096), help="with --kv-memory")
@click.option("--vs-hf", is_flag=True, help="also time transformers generate on the same settings (same run): with "
              "its own full cache (hf_decode_tok_s) and, for a policy that evicts, with that policy's evicting cache "
              "inside (hf_evicting_tok_s)")
@click.option("--repeat", default=1, show_default=True, type=click.IntRange(1, 100),
              help="run the configurations interleaved N times; report the median")
@click.option("--same-prompt", is_flag=True, help="one prompt for every row, prefilled once (long-context runs)")
@click.option("--compile/--no-compile", default=None, help="compile the decode step (default: on for cuda; on "
              "CPU it does not pay, see docs/benchmarks.md)")
@kv_bits_option
@engine_option
@click.option("--plot", "plot_path", default=None, help="draw decode tok/s, KV bytes and peak memory against "
              "prompt tokens, a line per configuration (.png/.pdf/.svg)")
@click.option("--json", "as_json", is_flag=True, help="one JSON object per configuration, as each finishes")
@click.option("--out", default=None, help="also write every row to this .jsonl file (at the end, or what finished "
              "on Ctrl-C)")
def bench(model, dtype, device, policies, budgets, recent, batches, prompt_tokens, new_tokens, prefill, text_path,
          sweep, kv_memory, max_batch, vs_hf, repeat, same_prompt, compile, kv_bits, engine, plot_path, as_json, out):
    """Prefill time, decode tokens/s, KV-cache bytes and peak memory of policies, side by side; each row is
    printed as its configuration finishes (a progress bar over the decode steps on a terminal)."""
    compile = device.startswith("cuda") and engine == "h2o-mini" if compile is None else compile
    if sweep:
        policies = policies or ("full", "local", "heavy_hitter", "h2o")
        budgets = budgets or ("0.1", "0.2", "0.5")
    if plot_path:
        check_image(plot_path)
    if out:
        check_output(out, (".jsonl",))
    if vs_hf:
        parallel.refuse("bench --vs-hf")  # transformers would load the whole model on every rank
        check_installed("transformers", "--vs-hf", "hf")
    text = read_text(text_path)
    lm = api.load(model, dtype, device, parallel.from_env(device), engine)
    rows, status = [], {}
    try:
        for row in run_bench(lm, policies, budgets, recent, batches or (1,), prompt_tokens or (512,), new_tokens,
                             prefill, text, kv_memory, max_batch, vs_hf, compile, repeat, same_prompt, kv_bits,
                             status):
            if not rows and not as_json:  # after every check has passed
                click.echo(table_header(vs_hf))
            rows.append(row)
            click.echo(json.dumps(row) if as_json else table_row(row, vs_hf))
    except KeyboardInterrupt:
        partial = unfinished_rows(status)  # the rounds that finished, not lost: their medians
        if partial and not rows and not as_json:
            click.echo(table_header(vs_hf))
        for row in partial:
            click.echo(json.dumps(row) if as_json else f"{table_row(row, vs_hf)}  ({row['rounds']} of {repeat} rounds)")
        rows += partial
        if partial:
            note(f"h2o-mini: interrupted: {len(partial)} configuration(s) shown with the medians of the rounds that "
                 "finished")
        elif not rows and status:  # nothing to show: say what was running and how far it got
            note(f"h2o-mini: interrupted before any configuration finished; running {status['label']}: "
                 f"{status['stage']}")
        if out and rows:
            write_rows(out, rows)
        raise
    if out:
        write_rows(out, rows)
    if plot_path and (lm.model.shard is None or lm.model.shard.rank == 0):  # one picture, from rank 0
        save_bench_plot(rows, Path(plot_path), f"{lm.folder.name}: decoding under eviction, prompts from "
                        f"{Path(text_path).name}, {new_tokens} new tokens")
        click.echo(f"wrote {plot_path}", err=True)


def write_rows(out: str, rows: list[dict]) -> None:
    """Every row as a JSON line, atomically (a whole file or none), from rank 0 alone under tensor parallel."""
    if parallel.is_main():
        write_atomic(out, lambda tmp: tmp.write_text("".join(json.dumps(r) + "\n" for r in rows)))
