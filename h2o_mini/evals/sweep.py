"""`h2o-mini eval sweep ppl|needle|tasks`: every policy at every budget, one table, one plot.

A sweep is a list of points (policy spec, budget); `full` is always one point, whatever the policies and
budgets. Each finished point's rows are appended to `--out` (JSON lines) at once and flushed, each with the
sweep's kind and settings, and a rerun with the same `--out` and the same settings skips the points already
there, so a long sweep survives an interruption. A point that fails (a plugin's fault, a refused setting, out
of memory) is named with its reason and written nowhere, the other points go on, and a rerun retries it. The
plot draws quality against budget, one line per policy, `full` as a horizontal line.
"""
from __future__ import annotations

import fcntl
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import torch

from ..errors import UserError, note
from ..files import check_output
from ..parallel import Shard, from_rank0, gather
from ..policies import REGISTRY, budget_if_taken, parse_budget

DEFAULT_BUDGETS = ("0.05", "0.1", "0.2", "0.5")
# kind -> (the number a point is judged by, how to read it off its rows, higher is better)
METRICS = {
    "ppl": ("ppl", lambda rows: rows[0]["ppl"]),
    "needle": ("found", lambda rows: sum(r["found"] for r in rows) / len(rows)),
    "tasks": ("score", lambda rows: rows[0]["score"]),
}


def points(policies, budgets, with_full: bool = True) -> list[tuple[str, str | None]]:
    """(policy spec, budget) pairs, `full` once whatever the budgets. A sweep always has it, first: it is the
    line every other policy is read against. A policy that takes no budget is one point."""
    policies = ("full",) * with_full + tuple(policies or REGISTRY)
    budgets = budgets or DEFAULT_BUDGETS
    return list(dict.fromkeys((p, budget_if_taken(p, b)) for p in policies for b in budgets))


def check_budget_kinds(budgets) -> None:
    """One plot's x axis is either fractions of the sequence or token counts: mixing them would draw 0.5 (say
    64 tokens) left of 1 (one token) on one line."""
    kinds = {type(parse_budget(b)) for b in budgets or ()}
    if len(kinds) > 1:
        raise UserError("--plot draws quality against the budget: give only fractions (0.1) or only token counts "
                        f"(64), not both ({', '.join(budgets)}); or leave out --plot")


class Failed(NamedTuple):
    """What `run_sweep` yields for a point that failed, in place of its rows."""
    reason: str


# What fails one point and not the sweep: a refused setting or a plugin's fault (UserError), or memory
FAILS_A_POINT = (UserError, MemoryError, getattr(torch, "OutOfMemoryError", MemoryError))


def contained(run_points: Callable, left: list[tuple]) -> Iterator[tuple[tuple, list[dict] | Failed]]:
    """run_points(left), and when it fails (the points of a batched pass fail together): the points it had not
    finished again in two halves, each the same way, so the points that do not fail still run batched and only
    a point that fails alone is reported, as `Failed` (a batch too large for memory shrinks the same way)."""
    done: set[tuple] = set()
    try:
        for point, rows in run_points(left):
            done.add(point)
            yield point, rows
        return
    except FAILS_A_POINT as e:
        rest = [p for p in left if p not in done]
        if len(rest) == 1:
            yield rest[0], Failed(_reason(e))
            return
    yield from contained(run_points, rest[:len(rest) // 2])
    yield from contained(run_points, rest[len(rest) // 2:])


def point_name(point: tuple) -> str:
    """'h2o 0.1', or 'full' for a point without a budget."""
    return " ".join(p for p in point if p)


def _reason(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text if isinstance(e, UserError) else f"{type(e).__name__}: {text}"


def _key(row: dict) -> tuple:
    return row["spec"], None if row["budget"] is None else str(row["budget"])


def finished(f, out: Path, kind: str, settings: dict) -> dict[tuple, list[dict]]:
    """The points an earlier run of the same sweep (same kind and settings) already wrote to the open file `f`.
    A file of another kind is refused; rows of other settings are never reused (one note says how many)."""
    done: dict[tuple, list[dict]] = {}
    f.seek(0)
    foreign, differ = 0, set()
    for n, line in enumerate(f.read().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if row.get("sweep") is None and "policy" in row and ("ppl" in row or "found" in row or "score" in row):
                raise UserError(f"{out}:{n} was written by an older h2o-mini, which did not record a sweep's "
                                "settings, so its rows cannot be safely reused: give another --out")
            row_kind, key = row.get("sweep"), _key(row)
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise UserError(f"{out}:{n} is not a row of an h2o-mini sweep: give another --out") from None
        if row_kind != kind:
            raise UserError(f"{out}:{n} is a row of a{'n' if str(row_kind)[:1] in 'aeiou' else ''} {row_kind} sweep, "
                            f"not of this {kind} sweep: give another --out")
        if row.get("settings") != settings:
            theirs = row.get("settings") if isinstance(row.get("settings"), dict) else {}
            differ |= {k for k in {*settings, *theirs} if theirs.get(k) != settings.get(k)}
            foreign += 1
            continue
        done.setdefault(key, []).append(row)
    if foreign:
        note(f"h2o-mini: note: {out} holds {foreign} rows with other settings ({', '.join(sorted(differ))}): they "
             "are kept in the file but not reused")
    return done


def run_sweep(kind: str, todo: list[tuple], run_points: Callable[[list[tuple]], Iterator[tuple[tuple, list[dict]]]],
              out: Path | None, settings: dict, progress: bool = True, ranks: Shard | None = None
              ) -> Iterator[tuple[tuple, list[dict]]]:
    """(point, rows) for every point, those of the same settings already in `out` first and not run again.
    run_points(points) runs the others and yields (point, rows) as each finishes, in any order (a batched pass
    finishes several at once; `one_by_one` runs them in turn). A point that fails gives (point, `Failed`): it
    is named on stderr, not written, and the others go on (`contained`). With `ranks` (torchrun: several
    processes, each with the whole model) the points left are split over the ranks, each running its share as one
    process would (batched); rank 0 alone reads and writes `out`, writes its own points as they finish and the
    others' when they are gathered, and yields them all; the other ranks yield nothing. `settings`: everything
    besides the point that changes a number (model, text, tokens, kv_bits, ...); each row written records it, and
    only rows with equal settings are reused. One writer at a time: a second sweep on the same file is refused while
    the first runs (an advisory lock on the file)."""
    from tqdm import tqdm
    main = ranks is None or ranks.rank == 0
    f, existed = None, out is not None and out.exists()
    if out is not None and main:
        check_output(out, (".jsonl",))
        try:
            f = open(out, "a+", encoding="utf-8")
        except OSError as e:
            raise UserError(f"cannot write {out}: {e.strerror}") from None
    try:
        if f is not None:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                raise UserError(f"another sweep is writing {out} right now: wait for it, or give another --out") from None
        done = finished(f, out, kind, settings) if f is not None else {}
        for point in todo if main else ():
            if point in done:
                yield point, done[point]
        left = from_rank0([p for p in todo if p not in done], ranks)
        mine = left if ranks is None else left[ranks.rank::ranks.size]

        def finish(point, rows):  # on rank 0: named if it failed, else written (a whole point per append)
            if isinstance(rows, Failed):
                note(f"h2o-mini: {point_name(point)}: failed: {rows.reason}")
                return point, rows
            rows = [dict(r, sweep=kind, spec=point[0], budget=point[1], settings=settings) for r in rows]
            if f is not None:
                f.write("".join(json.dumps(r) + "\n" for r in rows))
                f.flush()
            return point, rows
        theirs = []
        with tqdm(total=len(left), desc=f"sweep {kind}", unit="point", disable=not progress or not main or None) as bar:
            for point, rows in contained(run_points, mine) if mine else ():
                if main:
                    bar.set_postfix_str(f"{point[0]} {point[1] or ''}")
                    bar.update()
                    yield finish(point, rows)
                else:
                    theirs.append((point, rows))
            if ranks is not None:
                shares = gather(theirs, ranks)  # a collective: every rank takes part
                for point, rows in (item for share in shares[1:] for item in share) if main else ():
                    bar.update()
                    yield finish(point, rows)
    finally:
        if f is not None:
            empty = f.tell() == 0
            f.close()  # and the lock with it
            if empty and not existed:  # nothing was written: leave no empty file behind
                out.unlink(missing_ok=True)


def one_by_one(run_point: Callable[[str, str | None], list[dict]]):
    """`run_points` for a sweep whose points run one at a time: run_point(spec, budget) -> rows."""
    return lambda points: ((point, run_point(*point)) for point in points)


def summary(kind: str, results: dict[tuple, list[dict]]) -> list[dict]:
    name, metric = METRICS[kind]
    return [{"policy": p, "budget": b, name: metric(rows)} for (p, b), rows in results.items()]


def share(value: float, worse: float | None, better: float | None) -> float | None:
    """How much of the way from `worse` to `better` a value goes (1: all of it; negative: the wrong way); None
    where the way is under 0.1% of `better` (h2o already at full, say): a share of nothing reads as -10000%."""
    if worse is None or better is None or abs(worse - better) < 1e-3 * abs(better):
        return None
    return (worse - value) / (worse - better) + 0.0


def gaps(rows: list[dict]) -> list[dict]:
    """Perplexity rows with two shares of h2o's shortfall that a policy closes at its budget: of h2o's gap to
    full (`of_h2o_gap`: what keeping everything would give) and of its gap to hindsight (`of_hindsight`: what a
    choice of the same number of tokens made with the text ahead gives), where the sweep has those points."""
    at = {(r["policy"], r["budget"]): r["ppl"] for r in rows}
    full = next((r["ppl"] for r in rows if r["policy"] == "full"), None)
    return [dict(r, of_h2o_gap=share(r["ppl"], at.get(("h2o", r["budget"])), full) if r["budget"] else None,
                 of_hindsight=share(r["ppl"], at.get(("h2o", r["budget"])), at.get(("hindsight", r["budget"]))))
            for r in rows]


def table(kind: str, results: dict[tuple, list[dict]]) -> str:
    name = METRICS[kind][0]
    width = max([14] + [len(p) + 2 for p, _ in results])
    rows = summary(kind, results)
    present = {r["policy"] for r in rows}
    columns = [(key, title) for key, title, needs in (("of_h2o_gap", "of h2o's gap to full", "h2o"),
                                                      ("of_hindsight", "of h2o's gap to hindsight", "hindsight"))
               if kind == "ppl" and "h2o" in present and needs in present]
    lines = [f"{'policy':<{width}}{'budget':>8}  {name:>9}" + "".join(f"  {title}" for _, title in columns)]
    for row in gaps(rows) if columns else rows:
        line = f"{row['policy']:<{width}}{row['budget'] or 'all':>8}  {row[name]:>9.4f}"
        line += "".join(f"  {'' if row[key] is None else f'{row[key]:+.0%}':>{len(title)}}" for key, title in columns)
        lines.append(line.rstrip())
    if any(key == "of_hindsight" for key, _ in columns):
        lines.append("(hindsight is a reference, not a bound: a policy can pass it, over 100% of the gap)")
    return "\n".join(lines)


def save_sweep_plot(kind: str, results: dict[tuple, list[dict]], out, title: str) -> None:
    from ..views.plot import figure, line_style, plain_log_axis, save
    name = METRICS[kind][0]
    plt, fig, axes = figure(1, (6.4, 4.6))
    ax = axes[0]
    rows = summary(kind, results)
    for i, policy in enumerate(dict.fromkeys(r["policy"] for r in rows)):
        mine = sorted((float(r["budget"]), r[name]) for r in rows if r["policy"] == policy and r["budget"])
        if not mine:
            value = next(r[name] for r in rows if r["policy"] == policy)
            ax.axhline(value, color="black", linestyle="--", label=f"{policy}")
            continue
        ax.plot([b for b, _ in mine], [v for _, v in mine], label=policy, **line_style(plt, i))
    ax.set_xscale("log")
    ticks = sorted({float(r["budget"]) for r in rows if r["budget"]})
    plain_log_axis(ax.xaxis, ticks)
    if kind == "ppl":
        ax.set_yscale("log")
        plain_log_axis(ax.yaxis)
    counts = any(isinstance(parse_budget(r["budget"]), int) for r in rows if r["budget"])
    ax.set_xlabel("budget (tokens kept)" if counts else "budget (fraction of the sequence kept)")
    ax.set_ylabel({"ppl": "perplexity (lower is better)", "needle": "needle found (share of cells)",
                   "tasks": "task score"}[kind])
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))  # beside the axes: never over a line
    save(plt, fig, out)
