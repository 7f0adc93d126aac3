"""Prints the markdown tables of docs/results.md from the JSON lines docs/run_results.sh writes.

    python docs/results_tables.py [docs/results]
"""
import json
import sys
from pathlib import Path

out = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/results")


def rows(name):
    path = out / name
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


for text in ("GPL-3", "GFDL-1.3"):
    print(f"\n### {text}, 4096 tokens\n")
    print("| policy | budget | C | ppl | top-1 agree | KL vs full |")
    print("|---|---|---|---|---|---|")
    for r in rows(f"ablation_{text}.jsonl"):
        print(f"| {r['policy']} | {r['budget'] or 'all'} | {r['capacity']} | {r['ppl']:.2f} | "
              f"{r['top1_agree_full']:.3f} | {r['kl_full']:.3f} |")

print("\n### Attention power law\n")
print("| layer | tokens | top-20% share | max | median |")
print("|---|---|---|---|---|")
for r in rows("attention.jsonl"):
    print(f"| {r['layer']} | {r['tokens']} | {r['top20_share']:.3f} | {r['max']:.1f} | {r['median']:.2f} |")

for prefill in ("dense", "stream"):
    cells = rows(f"needle_{prefill}.jsonl")
    if not cells:
        continue
    lengths = sorted({c["length"] for c in cells})
    print(f"\n### Needle, prefill {prefill} (found / cells; depths {sorted({c['depth'] for c in cells})})\n")
    print("| policy | budget | " + " | ".join(f"{n} tokens" for n in lengths) + " |")
    print("|---|---|" + "---|" * len(lengths))
    for key in dict.fromkeys((c["policy"], c["budget"]) for c in cells):
        mine = [c for c in cells if (c["policy"], c["budget"]) == key]
        per = [[c["found"] for c in mine if c["length"] == n] for n in lengths]
        print(f"| {key[0]} | {key[1] or 'all'} | " + " | ".join(f"{sum(f)}/{len(f)}" for f in per) + " |")

print("\n### lm-eval: gpl_next_sentence\n")
print("| policy | budget | acc | acc_norm |")
print("|---|---|---|---|")
for r in rows("tasks.jsonl"):
    res = r["results"]["gpl_next_sentence"]
    print(f"| {r['policy']} | {r['budget'] or 'all'} | {res['acc,none']:.3f} | {res['acc_norm,none']:.3f} |")
