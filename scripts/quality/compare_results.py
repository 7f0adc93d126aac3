"""Compares a rerun of a sweep with the committed rows: the same (policy, parameters, budget) point, its NLL, KL to
full and top-1 agreement. Prints one line per point and the largest differences.

    python scripts/quality/compare_results.py results/quality/leaderboard_GPL-3.jsonl rerun.jsonl
"""
import json
import sys


def rows(path):
    with open(path) as f:
        return {(r["policy"], json.dumps(r["params"], sort_keys=True), r.get("budget")): r
                for r in map(json.loads, f) if "nll" in r}


old, new = rows(sys.argv[1]), rows(sys.argv[2])
worst = {"nll": 0.0, "kl_full": 0.0, "top1_agree_full": 0.0}
for key in sorted(new, key=str):
    if key not in old:
        print(f"{key}: not in {sys.argv[1]}")
        continue
    diffs = {k: abs(new[key][k] - old[key][k]) for k in worst if k in new[key] and k in old[key]}
    worst.update({k: max(worst[k], d) for k, d in diffs.items()})
    print(f"{key[0]:14s} {key[2] or '-':6s} nll {new[key]['nll']:.6f} (committed {old[key]['nll']:.6f})  "
          + "  ".join(f"|d {k}| {d:.1e}" for k, d in diffs.items()))
print(f"{len(set(new) & set(old))} points; largest differences: "
      + ", ".join(f"{k} {d:.1e}" for k, d in worst.items()))
