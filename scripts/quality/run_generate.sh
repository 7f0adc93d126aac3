#!/usr/bin/env bash
# docs/results.md section 11: what eviction does to long generations (h2o-mini eval generate), the built-in
# long-output prompts, every registered policy at 64 / 128 / 256 tokens and 0.1 / 0.2 of prompt + N.
#   scripts/quality/run_generate.sh [OUT] [MODELS] [N...]     default: results/generation, "default gemma3-270m", 512 1024
# Every point is one row per prompt; the points run as the rows of batched passes (32 rows at a time). Resumable:
# each point is appended to its .jsonl as it finishes, and a rerun skips the points already there.
#   python scripts/quality/results_tables.py results generate     prints the tables
set -euo pipefail
out=${1:-results/generation}
models=${2:-"default gemma3-270m"}
shift $(( $# < 2 ? $# : 2 ))
lengths=${*:-"512 1024"}
mkdir -p "$out"
policies=$(python3 -c "from h2o_mini.policies import REGISTRY; print(' '.join('--policy ' + n for n in REGISTRY))")
for model in $models; do
  for n in $lengths; do
    # token counts and fractions on two plots (one kind of budget per x axis), one file
    for budgets in "--budget 64 --budget 128 --budget 256" "--budget 0.1 --budget 0.2"; do
      kind=$([[ $budgets == *0.1* ]] && echo fraction || echo tokens)
      # shellcheck disable=SC2086
      h2o-mini eval generate --model "$model" --max-new-tokens "$n" $policies $budgets \
        --out "$out/generate_${model}_$n.jsonl" --plot "$out/generate_${model}_${n}_$kind.png" --json > /dev/null
    done
  done
done
