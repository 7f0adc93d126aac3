#!/usr/bin/env bash
# Reproduces every number in docs/benchmarks.md (CPU, fp32, the default model). About an hour and a quarter on 2 cores.
# Each target's ratio comes from configurations measured side by side in one process (`--repeat` interleaves
# them and reports medians: the machine is shared and noisy).
set -euo pipefail
out=${1:-results/benchmarks}
mkdir -p "$out"
gpl=/usr/share/common-licenses/GPL-3
budget() { [ "$1" = full ] || echo "--budget 0.2"; }  # full takes no budget
# Quality at budget 0.2: the four classic policies on 1024 tokens, with fidelity to full.
for p in full local heavy_hitter h2o; do
  h2o-mini eval ppl --text $gpl --tokens 1024 --policy $p $(budget $p) --compare-full --json
done > "$out/eval_1024.jsonl"
# Targets 1 and 5: dense prefill of 4096 tokens (batch 1), h2o 0.2 vs full; each configuration's peak memory.
h2o-mini bench --policy full --policy h2o --budget 0.2 --prompt-tokens 4096 --new-tokens 2 --repeat 3 --json > "$out/t1_prefill_4096.jsonl"
# Target 2: 8k context (8160 prompt + 32 new), batch 8: h2o 0.2 vs full decode rate.
h2o-mini bench --policy full --policy h2o --budget 0.2 --batch 8 --prompt-tokens 8160 --new-tokens 32 --same-prompt --json > "$out/t2_8k_batch8.jsonl"
# Target 3: batch 1 against transformers generate (128 + 128 tokens); the weight-streaming bound is in step_cost.
h2o-mini bench --policy full --prompt-tokens 128 --new-tokens 128 --repeat 3 --vs-hf --json > "$out/t3_batch1_vs_hf.jsonl"
# Target 4: the same KV-memory cap (256 MB), 512-token prompts + 2048 new tokens: the largest batch each fits.
h2o-mini bench --kv-memory 256MB --policy full --policy h2o --budget 0.2 --prompt-tokens 512 --new-tokens 2048 --json > "$out/t4_memory_capped.jsonl"
# Decode-step cost and what bounds it: weights alone, the step without a cache, full vs h2o (targets 2-4).
python scripts/benchmarks/step_cost.py > "$out/step_cost.txt"
# The curve: decode rate, KV bytes and peak memory against context, batch 4.
h2o-mini bench --policy full --policy h2o --budget 0.2 --prompt-tokens 512 --prompt-tokens 1024 --prompt-tokens 2048 \
  --prompt-tokens 4096 --batch 4 --new-tokens 16 --same-prompt --json --plot "$out/bench_context.png" > "$out/bench_context.jsonl"
# eval ppl of 4096 tokens, h2o 0.2 vs full (teacher forcing through the per-token rule).
for p in full h2o; do
  h2o-mini eval ppl --text $gpl --tokens 4096 --policy $p $(budget $p) --json
done > "$out/t5_eval_4096.jsonl"
# The picture in the README: which tokens local, heavy_hitter and h2o keep (layer 15, KV head 0).
h2o-mini plot kept --policy local --policy heavy_hitter --policy h2o --budget 64 --tokens 256 --layer 15 --out "$out/kept.png"
# Issue 36: where a sweep's time goes, every registered evicting policy at 0.1 and 0.2 (with expected_attention),
# then the 14 of the issue (without it). About 12 minutes.
python scripts/benchmarks/sweep_cost.py --json > "$out/sweep_cost.jsonl"
python scripts/benchmarks/sweep_cost.py --json --skip expected_attention >> "$out/sweep_cost.jsonl"
