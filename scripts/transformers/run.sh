#!/usr/bin/env bash
# Every number of docs/benchmarks.md "Inside transformers" (CPU, fp32, the default model; about 15 minutes on 2
# cores): eval ppl through both engines for h2o, tova and a plugin, and decode rates against transformers' own
# generate, every configuration side by side in one process (--repeat interleaves them, medians).
set -euo pipefail
out=${1:-results/transformers}
mkdir -p "$out"
gpl=/usr/share/common-licenses/GPL-3
plugin=scripts/transformers/vnorm.py:VNorm
for p in h2o tova $plugin; do
  for e in h2o-mini transformers; do
    h2o-mini eval ppl --text $gpl --tokens 2048 --policy $p --budget 0.1 --engine $e --json | python -c \
      "import json, sys; r = json.load(sys.stdin); r['engine'] = '$e'; print(json.dumps(r))"
  done
done > "$out/ppl_2048.jsonl"
# batch 1: transformers' generate with its own full cache (hf_decode_tok_s) and with h2o@0.2 inside
# (hf_evicting_tok_s); h2o-mini's loop over each engine beside them
for e in h2o-mini transformers; do
  h2o-mini bench --policy full --policy h2o --budget 0.2 --prompt-tokens 512 --new-tokens 128 --repeat 3 --vs-hf \
    --engine $e --json | python -c \
    "import json, sys; [print(json.dumps(dict(json.loads(l), engine='$e'))) for l in sys.stdin]"
done > "$out/bench_batch1.jsonl"
