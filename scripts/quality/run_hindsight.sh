#!/usr/bin/env bash
# docs/results.md section 10: the hindsight reference at 0.05 / 0.1 / 0.2 on the first 2048 tokens of two texts
# (with h2o again, which must equal section 5's rows), on the default model; Gemma 3 270M at 0.1 / 0.2 of 2048
# tokens of the GPL-3. About 25 minutes on 2 cores.
#   python scripts/quality/results_tables.py results hindsight     prints the tables
set -euo pipefail
out=${1:-results/hindsight}
lic=/usr/share/common-licenses
for text in GPL-3 GFDL-1.3; do
  h2o-mini eval sweep ppl --chunk 256 --text $lic/$text --tokens 2048 --policy h2o --policy hindsight \
    --budget 0.05 --budget 0.1 --budget 0.2 --out "$out/hindsight_$text.jsonl" --json > /dev/null
done
h2o-mini eval sweep ppl --chunk 256 --model gemma3-270m --text $lic/GPL-3 --tokens 2048 --policy h2o --policy local \
  --policy hindsight --budget 0.1 --budget 0.2 --out "$out/hindsight_gemma3-270m_GPL-3.jsonl" --json > /dev/null
