#!/usr/bin/env bash
# The policy leaderboard, the quantization table and the SnapKV needle of docs/results.md (issue 9), on the
# default model, CPU, fp32. About an hour on 2 cores. Sweeps append each finished point to their .jsonl and
# skip the points already there: an interrupted run picks up where it stopped.
#   python scripts/quality/results_tables.py results leaderboard     prints the tables
set -euo pipefail
out=${1:-results/quality}
mkdir -p "$out"
lic=/usr/share/common-licenses
# 1. Every registered policy at 0.05 / 0.1 / 0.2 on the first 2048 tokens of two texts, every token scored
#    in stream mode (ppl, top-1 agreement and KL against full, KV bytes).
for text in GPL-3 GFDL-1.3; do
  h2o-mini eval sweep ppl --chunk 256 --text $lic/$text --tokens 2048 --budget 0.05 --budget 0.1 --budget 0.2 \
    --out "$out/leaderboard_$text.jsonl" --plot "$out/leaderboard_$text.png" --json > /dev/null
done
# 2. h2o with keys and values at 8 and 4 bits, and fp32 at 0.4 too: which is better at equal KV bytes.
for text in GPL-3 GFDL-1.3; do
  for bits in 8 4; do
    h2o-mini eval sweep ppl --chunk 256 --text $lic/$text --tokens 2048 --policy h2o --budget 0.05 --budget 0.1 --budget 0.2 \
      --budget 0.4 --kv-bits $bits --out "$out/quant${bits}_$text.jsonl" --json > /dev/null
  done
  h2o-mini eval sweep ppl --chunk 256 --text $lic/$text --tokens 2048 --policy h2o --budget 0.4 --out "$out/quant32_$text.jsonl" \
    --json > /dev/null
done
# 3. The needle that h2o at 0.2 lost (docs/results.md), under SnapKV's observation window.
h2o-mini eval needle --lengths 1024,2048,3072 --depths 0.1,0.5,0.9 --policy snapkv --policy pyramidkv \
  --budget 0.2 --prefill dense --json --plot "$out/needle_snapkv.png" > "$out/needle_snapkv.jsonl"
