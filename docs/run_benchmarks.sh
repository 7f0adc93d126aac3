#!/usr/bin/env bash
# Reproduces every number in docs/benchmarks.md (CPU, fp32, the default model). About 45 minutes on 2 cores.
# On CPU `bench` runs eager by default (compiling does not pay there: docs/benchmarks.md); target 1 shows both.
# Each target's ratio comes from configurations measured side by side in one process.
set -euo pipefail
out=${1:-docs/results}
mkdir -p "$out"
gpl=/usr/share/common-licenses/GPL-3
# Quality at budget 0.2 (issue 3): the four policies on 1024 tokens, with fidelity to full.
budget() { [ "$1" = full ] || echo "--budget 0.2"; }  # full takes no budget
for p in full local heavy_hitter h2o; do
  h2o-mini eval ppl --text $gpl --tokens 1024 --policy $p $(budget $p) --compare-full --json
done > "$out/eval_1024.jsonl"
# Target 1: compiled decode vs transformers generate, batch 1, 128 new tokens (and eager, for reference).
h2o-mini bench --policy full --prompt-tokens 128 --new-tokens 128 --repeat 3 --vs-hf --compile --json > "$out/t1_compiled_vs_hf.jsonl"
h2o-mini bench --policy full --prompt-tokens 128 --new-tokens 128 --repeat 3 --vs-hf --no-compile --json > "$out/t1_eager_vs_hf.jsonl"
# Target 2: h2o decode step vs local decode step at the same C.
h2o-mini bench --policy local --policy h2o --budget 0.2 --prompt-tokens 512 --new-tokens 128 --repeat 5 --json > "$out/t2_h2o_vs_local.jsonl"
# Target 3: 8k context (8160 prompt + 32 new), batch 8: h2o at 0.2 vs full.
h2o-mini bench --policy full --policy h2o --budget 0.2 --batch 8 --prompt-tokens 8160 --new-tokens 32 --same-prompt --json > "$out/t3_8k_batch8.jsonl"
# Target 4: the same KV-memory cap (256 MB), 512-token prompts + 2048 new tokens: the largest batch each fits.
h2o-mini bench --kv-memory 256MB --policy full --policy h2o --budget 0.2 --prompt-tokens 512 --new-tokens 2048 --json > "$out/t4_memory_capped.jsonl"
# Target 5: eval ppl of 4096 tokens, h2o 0.2 vs full.
for p in full h2o; do
  h2o-mini eval ppl --text $gpl --tokens 4096 --policy $p $(budget $p) --json
done > "$out/t5_eval_4096.jsonl"
# Decode-step cost at the shapes of targets 3 and 4, eager vs compiled (cache filled with random K/V).
python docs/step_cost.py > "$out/step_cost.txt"
# The picture in the README: which tokens local, heavy_hitter and h2o keep (layer 15, KV head 0).
h2o-mini plot kept --policy local --policy heavy_hitter --policy h2o --budget 64 --tokens 256 --layer 15 --out "$out/kept.png"
