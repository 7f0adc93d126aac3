"""Where a sweep's time goes: `eval sweep ppl` over every registered evicting policy at 0.1 and 0.2, as one batch,
with its wall time split into the parts that run it (docs/benchmarks.md, "The per-token loop (issue 36)").

Every part is timed where it runs, in this process, by wrapping it (one thread, one part at a time, so the parts
never overlap and add up to the wall):

* scoring: the head and the NLL / KL of every row's logits (`ppl.tally` and `model.head`);
* setup: per layer and chunk, the virtual slots gathered and the survivors compacted (`prompt._Read`);
* loop: the per-token body (`prompt.stream_token`) less the rules' hooks inside it;
* hooks: each rule's own hooks (keep_score, update, accumulate, observe, ...), per rule, wherever they run (and,
  as `hooks_us_per_token`, per token, layer and row of one of its points);
* attention: the rest of `prompt.stream_many` (the chunk's logits, its masked softmax and output);
* forward: everything else (the linear layers, norms and RoPE of every row, the wavefront's own loop).

Then against one full read per point: in this process (the read and its scoring), and as issue 36 measures it,
the wall of the command `h2o-mini eval ppl --policy full` (loading the model included); its target for the sweep
is 0.75x of the latter. The sweep's own time here is its batched pass (`score_many`), without the command's
loading and full's reference pass.

    python scripts/benchmarks/sweep_cost.py [--tokens 2048] [--model M] [--chunk 128] [--json]
        [--policy NAME ...]    these only (default: every registered policy that evicts)
        [--skip NAME ...]      or every one but these
"""
import argparse
import json
import subprocess
import sys
import time
from collections import defaultdict

import torch

from h2o_mini import api, prompt
from h2o_mini.evals import ppl
from h2o_mini.policies import REGISTRY, make_policy
from h2o_mini.policies.guard import HOOKS

GPL3 = "/usr/share/common-licenses/GPL-3"
spent = defaultdict(float)
inside = []  # the part a hook runs in ("loop", "setup"), innermost last


def timed(key, fn):
    """fn, its time added to spent[key]; a hook (key a function of its arguments) is timed at its outermost call
    only (keep_score may call a parent's) and also added to the part it runs in."""
    def wrapper(*a, **kw):
        name = key(a) if callable(key) else key
        if callable(key) and name in inside:
            return fn(*a, **kw)
        inside.append(name)
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            inside.pop()
            dt = time.perf_counter() - t0
            spent[name] += dt
            if callable(key) and inside and inside[-1] in ("loop", "setup"):
                spent[f"hooks in {inside[-1]}"] += dt
    return wrapper


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--model", default=None)
    ap.add_argument("--chunk", type=int, default=ppl.CHUNK)
    ap.add_argument("--policy", action="append",
                    help="(repeatable) these only; default: every registered one that evicts")
    ap.add_argument("--skip", action="append", default=[], help="(repeatable) leave this registered policy out")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    lm = api.load(args.model)
    ids = api.scored_ids(lm, open(GPL3).read(), args.tokens)
    T = len(ids)
    names = args.policy or [name for name, cls in REGISTRY.items() if cls.takes_budget and name not in args.skip]
    points = [(name, b) for name in names for b in ("0.1", "0.2")]
    policies = [make_policy(name, b, T, quiet=True) for name, b in points]
    # what issue 36's target is measured against: the wall of the command `eval ppl --policy full` (load included)
    command = [sys.executable, "-m", "h2o_mini", "eval", "ppl", "--text", GPL3, "--tokens", str(args.tokens),
               "--policy", "full", "--json"] + (["--model", args.model] if args.model else [])
    t0 = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True)
    command_s = time.perf_counter() - t0
    with torch.inference_mode():
        full = make_policy("full", None, T)
        ppl.score_text(lm.model, ids, full, args.chunk, progress=False)  # warm
        full_s = ppl.score_text(lm.model, ids, full, args.chunk, progress=False)["seconds"]  # `eval ppl`'s read
        reference = ppl.full_logprobs(lm.model, ids)
        # The parts, wrapped (the class attributes: every instance and every layer's copy runs through them).
        for cls in {type(p) for p in policies}:
            for hook in HOOKS:
                setattr(cls, hook, timed(lambda a: f"hooks: {a[0].name}", getattr(cls, hook)))
        prompt.stream_token = timed("loop", prompt.stream_token)
        prompt._Read.__init__ = timed("setup", prompt._Read.__init__)
        prompt._Read.finish = timed("setup", prompt._Read.finish)
        prompt.stream_many = timed("in stream_many", prompt.stream_many)
        ppl.tally = timed("scoring", ppl.tally)
        lm.model.head = timed("scoring", lm.model.head)
        t0 = time.perf_counter()
        results = dict(ppl.score_many(lm.model, ids, policies, reference, args.chunk, progress=False))
        wall = time.perf_counter() - t0
    hooks = {k: v for k, v in spent.items() if k.startswith("hooks: ")}
    rows = {f"hooks: {name}": sum(n == name for n, _ in points) for name in names}  # points of each rule
    elsewhere = sum(hooks.values()) - spent["hooks in loop"] - spent["hooks in setup"]  # e.g. before the first eviction
    parts = {"forward": wall - spent["in stream_many"] - spent["scoring"], "scoring": spent["scoring"],
             "attention": spent["in stream_many"] - spent["setup"] - spent["loop"] - elsewhere,
             "setup (less its hooks)": spent["setup"] - spent["hooks in setup"],
             "loop (less its hooks)": spent["loop"] - spent["hooks in loop"],
             **dict(sorted(hooks.items(), key=lambda kv: -kv[1]))}
    row = {"tokens": T, "chunk": args.chunk, "points": len(points), "threads": torch.get_num_threads(),
           "full_read_s": round(full_s, 2), "full_command_s": round(command_s, 2), "sweep_s": round(wall, 1),
           "sweep_over_full_reads": round(wall / (len(points) * full_s), 3),
           "sweep_over_full_commands": round(wall / (len(points) * command_s), 3),
           "parts_s": {k: round(v, 1) for k, v in parts.items()},
           # each rule's hooks per token, layer and row (one of its points): what one step of its rule costs
           "hooks_us_per_token": {k[len("hooks: "):]: round(v * 1e6 / (rows[k] * T * lm.model.cfg.n_layer), 2)
                                  for k, v in sorted(hooks.items(), key=lambda kv: -kv[1])},
           "nll_h2o_0.1": results[points.index(("h2o", "0.1"))]["nll"] if ("h2o", "0.1") in points else None}
    if args.json:
        print(json.dumps(row))
        return
    print(f"{len(points)} points of {T} tokens: {wall:.1f} s = {row['sweep_over_full_reads']:.2f} x {len(points)} full "
          f"reads in this process ({full_s:.2f} s each) = {row['sweep_over_full_commands']:.2f} x {len(points)} "
          f"`eval ppl --policy full` commands ({command_s:.2f} s each, issue 36's measure)")
    for k, v in parts.items():
        print(f"  {k:30s} {v:7.1f} s  {v / wall:6.1%}  {v / (len(points) * command_s):.3f} x the commands")
    print("each rule's hooks per token, layer and row: " + ", ".join(
        f"{k} {v:.1f} us" for k, v in row["hooks_us_per_token"].items()))


if __name__ == "__main__":
    main()
