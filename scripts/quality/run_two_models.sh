#!/usr/bin/env bash
# The two-model results of docs/results.md section 9 (issue 19): SmolLM2-135M (30 global layers) against
# Gemma 3 270M (15 sliding-window layers of 512 + 3 global), CPU, fp32. Sweeps append each finished point to
# their .jsonl and skip the points already there: an interrupted run picks up where it stopped. About 2.5 hours
# on 2 cores run one after another (the sessions that made results ran the two models side by side, one
# thread each: `OMP_NUM_THREADS=1 scripts/quality/run_two_models.sh results default &` and the same for gemma3-270m).
#   python scripts/quality/results_tables.py results models     prints the tables
set -euo pipefail
out=${1:-results/models}
models=${2:-"default gemma3-270m"}
mkdir -p "$out"
lic=/usr/share/common-licenses
for model in $models; do
  # 1. Every registered policy at 0.1 / 0.2 of the first 4096 tokens of two texts (C = 410 / 819: below and above
  #    Gemma's window of 512), every token scored in stream mode, against full on the same run.
  for text in GPL-3 GFDL-1.3; do
    h2o-mini eval sweep ppl --chunk 256 --model "$model" --text $lic/$text --tokens 4096 --budget 0.1 --budget 0.2 \
      --out "$out/models_${model}_$text.jsonl" --plot "$out/models_${model}_$text.png" --json > /dev/null
  done
  # 2. The needle at 1k / 2k / 4k tokens, three depths, under full, h2o and local at 0.2 (dense prefill).
  h2o-mini eval needle --model "$model" --lengths 1024,2048,4096 --depths 0.1,0.5,0.9 --policy full --policy h2o \
    --policy local --budget 0.2 --prefill dense --json --plot "$out/models_needle_$model.png" \
    > "$out/models_needle_$model.jsonl"
done
# 3. Speed and memory on Gemma 3: full against h2o at 0.2, 4k and 8k prompts, 32 new tokens, side by side.
if [[ " $models " == *" gemma3-270m "* ]]; then
  h2o-mini bench --model gemma3-270m --policy full --policy h2o --budget 0.2 --prompt-tokens 4096 \
    --prompt-tokens 8192 --new-tokens 32 --json > "$out/models_bench_gemma3-270m.jsonl"
fi
