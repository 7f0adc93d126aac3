#!/usr/bin/env bash
# Reproduces every number and picture of docs/results.md (CPU, fp32, the default model). About 75 minutes
# on 2 cores. Sweeps append each finished point to their .jsonl and skip the points already there, so an
# interrupted run picks up where it stopped: run it again with the same folder.
set -euo pipefail
out=${1:-results/quality}
mkdir -p "$out"
lic=/usr/share/common-licenses
# 1. The ablation: H2O, its two halves and sinks at 0.05 / 0.1 / 0.2 / 0.5, 4096 tokens of two texts (every
#    registered policy at 2048 tokens: scripts/quality/run_leaderboard.sh).
for text in GPL-3 GFDL-1.3; do
  h2o-mini eval sweep ppl --chunk 256 --text $lic/$text --tokens 4096 --policy local --policy heavy_hitter --policy h2o \
    --policy sinks --out "$out/ablation_$text.jsonl" \
    --plot "$out/ablation_$text.png" --json > /dev/null
done
# 2. The attention power law (the heavy-hitter observation), 1024 tokens of GPL-3.
h2o-mini plot attention --text $lic/GPL-3 --tokens 1024 --layers 0,15,29 --out "$out/attention.png" --json \
  > "$out/attention.jsonl"
# 3. Needle in a haystack: h2o and local at 0.2, both prefill modes, and full (whose cache never evicts,
#    so its two modes are the same computation: run once, with dense).
h2o-mini eval needle --lengths 1024,2048,3072 --depths 0.1,0.5,0.9 --policy full --policy h2o --policy local \
  --budget 0.2 --prefill dense --json --plot "$out/needle_dense.png" > "$out/needle_dense.jsonl"
h2o-mini eval needle --lengths 1024,2048,3072 --depths 0.1,0.5,0.9 --policy h2o --policy local \
  --budget 0.2 --prefill stream --json --plot "$out/needle_stream.png" > "$out/needle_stream.jsonl"
# 4. lm-eval: the shipped next-sentence task (first 50 items, 2-shot) under each policy at C = 32 tokens
#    (a token count batches every request together; a fraction gives each request its own C).
h2o-mini eval sweep tasks --tasks gpl_next_sentence --num-fewshot 2 --limit 50 --batch-size 16 --policy full --policy local \
  --policy heavy_hitter --policy h2o --policy sinks --budget 32 --out "$out/tasks.jsonl" --json > /dev/null
