#!/usr/bin/env bash
# The policies of the policy workbench (issue 18) in the leaderboard of docs/results.md, on the default model,
# CPU, fp32: a2sf (gamma 0.99, and swept over 0.9 / 0.95 / 0.999), vatp, paged_h2o and rkv beside h2o at
# 0.05 / 0.1 / 0.2 of the first 2048 tokens of two texts, every token scored in stream mode. About 15 minutes
# on 2 cores. The sweep appends each finished point and skips the points already there (same settings).
#   python scripts/quality/results_tables.py results workbench     prints the tables
set -euo pipefail
out=${1:-results/quality}
mkdir -p "$out"
lic=/usr/share/common-licenses
for text in GPL-3 GFDL-1.3; do
  h2o-mini eval sweep ppl --chunk 256 --text $lic/$text --tokens 2048 --budget 0.05 --budget 0.1 --budget 0.2 \
    --policy h2o --policy a2sf --policy vatp --policy paged_h2o --policy rkv \
    --policy a2sf:gamma=0.9 --policy a2sf:gamma=0.95 --policy a2sf:gamma=0.999 \
    --out "$out/workbench_$text.jsonl" --plot "$out/workbench_$text.png" --json > /dev/null
done
