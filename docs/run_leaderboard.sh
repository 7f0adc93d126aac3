#!/usr/bin/env bash
# The policy leaderboard and the quantization table of docs/policies.md (issue 9): every registered policy at
# budgets 0.05 / 0.1 / 0.2 on the first 2048 tokens of two real texts, every token scored in stream mode, then
# h2o with keys and values at 16 (fp32 here) / 8 / 4 bits. Resumable: a rerun skips the finished points.
# About 70 minutes on 2 CPU cores. Tables: python docs/results_tables.py leaderboard
set -euo pipefail
cd "$(dirname "$0")/.."
out=docs/results
for text in GPL-3 GFDL-1.3; do
  h2o-mini eval sweep ppl --text /usr/share/common-licenses/$text --tokens 2048 --budget 0.05 --budget 0.1 \
      --budget 0.2 --out $out/leaderboard_$text.jsonl --plot $out/leaderboard_$text.png
done
for text in GPL-3 GFDL-1.3; do
  for bits in 8 4; do
    h2o-mini eval sweep ppl --text /usr/share/common-licenses/$text --tokens 2048 --policy h2o --budget 0.05 \
        --budget 0.1 --budget 0.2 --budget 0.4 --kv-bits $bits --out $out/quant${bits}_$text.jsonl
  done
done
