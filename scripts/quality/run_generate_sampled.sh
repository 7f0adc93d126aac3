#!/usr/bin/env bash
# docs/results.md section 11, sampled texts: eval generate with --temperature 1 (the model's own distribution;
# greedy texts of these small models loop), the draws coupled by --seed 0 so that full and every policy share
# them; every registered policy at 128 and 256 tokens, N = 512, on the built-in prompts.
#   scripts/quality/run_generate_sampled.sh [OUT] [MODELS]     default: results/generation, "gemma3-270m default"
# Resumable like scripts/quality/run_generate.sh; tables: python scripts/quality/results_tables.py results generate
set -euo pipefail
out=${1:-results/generation}
models=${2:-"gemma3-270m default"}
mkdir -p "$out"
policies=$(python3 -c "from h2o_mini.policies import REGISTRY; print(' '.join('--policy ' + n for n in REGISTRY))")
for model in $models; do
  # shellcheck disable=SC2086
  h2o-mini eval generate --model "$model" --max-new-tokens 512 --temperature 1 --seed 0 $policies \
    --budget 128 --budget 256 --out "$out/generate_sampled_${model}_512.jsonl" \
    --plot "$out/generate_sampled_${model}_512.png" --json > /dev/null
done
