"""`h2o-mini plot kept`: which tokens each policy keeps, step by step, as one picture.

A real text goes through the model one token at a time (teacher forcing) under each policy; the recorder
(`record.py`, shared with `h2o-mini explore`) notes when each position leaves each layer and KV head. The
picture has the step t across and the position p down: a cell is dark while token p is in the cache at step t.
`local` draws a diagonal band; `h2o` draws the same band plus horizontal lines, the heavy hitters it keeps for a
long time.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..api import LM
from ..errors import UserError
from ..files import write_atomic
from ..policies import Policy
from .record import record_many


def kept_matrices(lm: LM, ids: list[int], policies: list[Policy], layer: int, head: int) -> list[torch.Tensor]:
    """(T, T) bool per policy: [p, t] is True when position p is cached after step t, in `layer`, KV `head`
    (read off the recorder that `explore` uses too, every policy a row of one pass: `record.py`)."""
    cfg = lm.model.cfg
    if not 0 <= layer < cfg.n_layer or not 0 <= head < cfg.n_kv_head:
        raise UserError(f"--layer must be in [0, {cfg.n_layer}) and --head in [0, {cfg.n_kv_head})")
    return [rec.kept_matrix(layer, head) for rec in record_many(lm.model, ids, policies, snapshots=1)]


def figure(panels: int, size: tuple[float, float]):
    """(pyplot, figure, axes) with `panels` side by side, on the file-only Agg backend."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("plotting needs matplotlib: pip install 'h2o-mini[plot]'") from None
    fig, axes = plt.subplots(1, panels, figsize=(size[0] * panels, size[1]), squeeze=False)
    return plt, fig, list(axes[0])


def save(plt, fig, out, tight: bool = True) -> None:
    """Write the figure atomically (a complete picture or none), then free it."""
    if tight:
        fig.tight_layout()
    try:
        write_atomic(out, lambda tmp: fig.savefig(tmp, dpi=110))
    finally:
        plt.close(fig)


def plain_log_axis(axis, ticks=None) -> None:
    """Plain numbers on a log axis (20, 30, 0.05, 1024), not matplotlib's 2x10^1 or 2^10; `ticks`: exactly these."""
    from matplotlib.ticker import FuncFormatter, NullFormatter
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    if ticks is not None:
        axis.set_ticks(ticks)
        axis.set_minor_formatter(NullFormatter())
        axis.set_ticks([], minor=True)
    else:
        axis.set_minor_formatter(plain)
    axis.set_major_formatter(plain)


def save_kept_plot(matrices: dict[str, torch.Tensor], out: Path, title: str) -> None:
    plt, fig, axes = figure(len(matrices), (4, 4.4))
    for ax, (label, kept) in zip(axes, matrices.items()):
        ax.imshow(kept.numpy(), cmap="Greys", interpolation="nearest", aspect="auto")
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("step t (token arriving)")
        ax.set_ylabel("position p (token kept)")
    fig.suptitle(title, fontsize=11)
    save(plt, fig, out)


def save_heatmaps(panels: dict[str, dict[tuple[float, int], float]], out: Path, title: str) -> None:
    """One heat map per panel: depth (down) x length (across), the share of cells where the needle was found."""
    plt, fig = heatmap_figure(panels, title)
    save(plt, fig, out, tight=False)


def heatmap_figure(panels: dict[str, dict[tuple[float, int], float]], title: str):
    """(pyplot, figure) of `save_heatmaps`, with a shared colour bar whose labels fit inside the picture."""
    plt, fig, axes = figure(len(panels), (3.6, 3.4))
    for ax, (label, cells) in zip(axes, panels.items()):
        depths = sorted({d for d, _ in cells})
        lengths = sorted({n for _, n in cells})
        grid = [[cells.get((d, n), float("nan")) for n in lengths] for d in depths]
        image = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("needle depth")
        ax.set_title(label, fontsize=9)
    fig.suptitle(title, fontsize=10)
    right = 1 - 0.9 / fig.get_figwidth()  # room on the right for the shared colour bar and its labels (0.9 in)
    fig.tight_layout(rect=(0, 0, right, 1))
    bar = fig.colorbar(image, cax=fig.add_axes((right + 0.1 / fig.get_figwidth(), 0.15, 0.12 / fig.get_figwidth(), 0.7)))
    bar.set_ticks([0, 0.25, 0.5, 0.75, 1], labels=["0%", "25%", "50%", "75%", "100%"])
    bar.ax.tick_params(labelsize=8)
    bar.ax.set_title("found", fontsize=8)
    return plt, fig


def save_bench_plot(rows: list[dict], out: Path, title: str) -> None:
    """`bench --plot`: decode tokens/s, KV-cache bytes and peak memory against prompt tokens, one line per
    policy and budget (and batch, and KV bits, where those vary)."""
    vary = [k for k in ("batch", "kv_bits") if len({r[k] for r in rows}) > 1]
    lines: dict[str, list[dict]] = {}
    for r in rows:
        label = " ".join([r["policy"]] + ([f"{r['budget']}"] if r["budget"] is not None else [])
                         + [f"{k}={r[k]}" for k in vary])
        lines.setdefault(label, []).append(r)
    panels = [("decode_tok_s", "decode tokens/s", 1), ("kv_bytes", "KV cache (MB)", 1e6),
              ("peak_mem_bytes", "peak memory (MB)", 1e6)]
    plt, fig, axes = figure(len(panels), (4.2, 3.6))
    for ax, (key, name, unit) in zip(axes, panels):
        for label, points in lines.items():
            points = sorted((p["prompt_tokens"], p[key] / unit) for p in points if p[key] is not None)
            if points:
                ax.plot(*zip(*points), marker="o", label=label)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(name)
        ax.set_xscale("log", base=2)
        plain_log_axis(ax.xaxis, sorted({r["prompt_tokens"] for r in rows}))
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    save(plt, fig, out)


def line_style(plt, i: int) -> dict:
    """The i-th line's colour and marker: tab20's 20 colours (the dark ones first) and 12 markers, so that none
    of the registered policies' lines looks like another's."""
    colours = plt.get_cmap("tab20").colors
    return {"color": colours[(2 * i) % 20 + (2 * i) // 20 % 2], "marker": "osD^vP*Xh<>p"[i % 12]}


def save_generation_plot(rows: list[dict], out: Path, title: str) -> None:
    """eval generate: tokens before the first divergence from full, and the reference's NLL under the policy,
    against budget; one line per policy, full as a dashed line."""
    from ..policies import parse_budget
    plt, fig, (agree, nll) = figure(2, (5.2, 4.2))
    counts = any(isinstance(parse_budget(r["budget"]), int) for r in rows if r["budget"])
    for i, policy in enumerate(dict.fromkeys(r["policy"] for r in rows)):
        mine = sorted((float(r["budget"]), r) for r in rows if r["policy"] == policy and r["budget"])
        for ax, key in ((agree, "agree_tokens"), (nll, "nll")):
            if not mine:
                ax.axhline(next(r[key] for r in rows if r["policy"] == policy), color="black", linestyle="--",
                           label=policy)
            else:
                ax.plot([b for b, _ in mine], [r[key] for _, r in mine], label=policy, **line_style(plt, i))
    for ax, label in ((agree, "tokens equal to full's before the first difference"), (nll, "NLL of full's text (nats)")):
        ax.set_xscale("log")
        plain_log_axis(ax.xaxis, sorted({float(r["budget"]) for r in rows if r["budget"]}))
        ax.set_xlabel("budget (tokens kept)" if counts else "budget (fraction of prompt + new tokens)")
        ax.set_ylabel(label)
    nll.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.suptitle(title, fontsize=10)
    save(plt, fig, out)
