"""`h2o-mini eval sweep ppl|needle|tasks`: every policy at every budget, one table, one plot.

A sweep is a list of points (policy, budget); `full` is always one point, whatever the policies and budgets. Each finished
point's rows are appended to `--out` (JSON lines) at once and flushed, and a rerun with the same `--out`
skips the points already there, so a long sweep survives an interruption. The plot draws quality against
budget, one line per policy, `full` as a horizontal line.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

from ..errors import UserError
from ..files import check_output
from ..policies import REGISTRY

DEFAULT_BUDGETS = ("0.05", "0.1", "0.2", "0.5")
# kind -> (the number a point is judged by, how to read it off its rows, higher is better)
METRICS = {
    "ppl": ("ppl", lambda rows: rows[0]["ppl"]),
    "needle": ("found", lambda rows: sum(r["found"] for r in rows) / len(rows)),
    "tasks": ("score", lambda rows: rows[0]["score"]),
}


def points(policies, budgets, with_full: bool = True) -> list[tuple[str, str | None]]:
    """(policy, budget) pairs, `full` once whatever the budgets. A sweep always has it, first: it is the line
    every other policy is read against."""
    policies = ("full",) * with_full + tuple(policies or REGISTRY)
    budgets = budgets or DEFAULT_BUDGETS
    return list(dict.fromkeys((p, None if p == "full" else b) for p in policies for b in budgets))


def _key(row: dict) -> tuple:
    return row["policy"], None if row["policy"] == "full" else str(row["budget"])


def finished(out: Path | None) -> dict[tuple, list[dict]]:
    """The points an earlier run of the same sweep already wrote to `out`."""
    done: dict[tuple, list[dict]] = {}
    if out is None or not out.exists():
        return done
    for n, line in enumerate(out.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            done.setdefault(_key(row), []).append(row)
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UserError(f"{out}:{n} is not a row of an h2o-mini sweep") from None
    return done


def run_sweep(kind: str, todo: list[tuple], run_point: Callable[[str, str | None], list[dict]],
              out: Path | None, progress: bool = True) -> Iterator[tuple[tuple, list[dict]]]:
    """(point, rows) for every point, those already in `out` first and not run again."""
    from tqdm import tqdm
    if out is not None:
        check_output(out, (".jsonl",))
    done = finished(out)
    for point in todo:
        if point in done:
            yield point, done[point]
    bar = tqdm([p for p in todo if p not in done], desc=f"sweep {kind}", unit="point", disable=not progress or None)
    for point in bar:
        bar.set_postfix_str(f"{point[0]} {point[1] or ''}")
        rows = run_point(*point)
        if out is not None:
            with open(out, "a", encoding="utf-8") as f:  # a whole point per append: never half a point
                f.write("".join(json.dumps(dict(r, budget=point[1])) + "\n" for r in rows))
                f.flush()
        yield point, rows


def summary(kind: str, results: dict[tuple, list[dict]]) -> list[dict]:
    name, metric = METRICS[kind]
    return [{"policy": p, "budget": b, name: metric(rows)} for (p, b), rows in results.items()]


def table(kind: str, results: dict[tuple, list[dict]]) -> str:
    name = METRICS[kind][0]
    lines = [f"{'policy':<14}{'budget':>8}  {name}"]
    for row in summary(kind, results):
        lines.append(f"{row['policy']:<14}{row['budget'] or 'all':>8}  {row[name]:.4f}")
    return "\n".join(lines)


def save_sweep_plot(kind: str, results: dict[tuple, list[dict]], out, title: str) -> None:
    from ..plot import figure, save
    name = METRICS[kind][0]
    plt, fig, axes = figure(1, (6.4, 4.6))
    ax = axes[0]
    rows = summary(kind, results)
    for policy in dict.fromkeys(r["policy"] for r in rows):
        mine = sorted((float(r["budget"]), r[name]) for r in rows if r["policy"] == policy and r["budget"])
        if policy == "full" or not mine:
            value = next(r[name] for r in rows if r["policy"] == policy)
            ax.axhline(value, color="black", linestyle="--", label=f"{policy}")
            continue
        ax.plot([b for b, _ in mine], [v for _, v in mine], marker="o", label=policy)
    ax.set_xscale("log")
    ticks = sorted({float(r["budget"]) for r in rows if r["budget"]})
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.minorticks_off()
    if kind == "ppl":
        ax.set_yscale("log")
    ax.set_xlabel("budget (fraction of the sequence, or tokens)")
    ax.set_ylabel({"ppl": "perplexity (lower is better)", "needle": "needle found (share of cells)",
                   "tasks": "task score"}[kind])
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    save(plt, fig, out)
