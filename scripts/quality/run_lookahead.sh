#!/usr/bin/env bash
# docs/results.md section 12: the rules that predict the attention to come (expected_attention, learned) against
# h2o, a2sf, vatp, tova and the hindsight ceiling, at 0.05 / 0.1 / 0.2 of 2048 tokens of two texts that neither
# rule was tuned or fitted on (GPL-3, GFDL-1.3), on SmolLM2-135M and Gemma 3 270M; then long sampled generations.
# The rules are fitted on Apache-2.0 (a committed file is reused, not refitted). About 2.5 hours on 2 cores.
#   scripts/quality/run_lookahead.sh [OUT]     default: results/lookahead
# Resumable: every sweep appends each finished point to its .jsonl and a rerun skips the points already there.
#   python scripts/quality/results_tables.py results lookahead     prints the tables
set -euo pipefail
out=${1:-results/lookahead}
mkdir -p "$out"
lic=/usr/share/common-licenses
others="--policy h2o --policy a2sf --policy vatp --policy tova --policy expected_attention"
budgets="--budget 0.05 --budget 0.1 --budget 0.2"
for model in default gemma3-270m; do
  name=$([ $model = default ] && echo smollm2 || echo $model)
  rule="$out/learned_${name}_apache-2.0.safetensors"
  [ -f "$rule" ] || h2o-mini learn-policy --model $model --text $lic/Apache-2.0 --tokens 2048 --budget 0.1 \
    --samples 32 --out "$rule" --json > /dev/null
  tag=$([ $model = default ] && echo "" || echo "${model}_")
  for text in GPL-3 GFDL-1.3; do
    # shellcheck disable=SC2086
    h2o-mini eval sweep ppl --model $model --chunk 256 --text $lic/$text --tokens 2048 $others \
      --policy "learned:weights=$rule" --policy hindsight $budgets --out "$out/lookahead_${tag}$text.jsonl" \
      --json > /dev/null
  done
done
# Sampled generations (section 11's measure). Section 11 has every registered policy's rows for both models
# (scripts/quality/run_generate_sampled.sh); these runs add the two new rules, and full, which must equal section 11's.
for model in default gemma3-270m; do
  name=$([ $model = default ] && echo smollm2 || echo $model)
  suffix=$([ $model = default ] && echo default || echo $model)
  h2o-mini eval generate --model $model --max-new-tokens 512 --temperature 1 --seed 0 --policy expected_attention \
    --policy "learned:weights=$out/learned_${name}_apache-2.0.safetensors" --budget 128 --budget 256 \
    --out "$out/lookahead_generate_sampled_${suffix}_512.jsonl" --json > /dev/null
done
