#!/usr/bin/env bash
# docs/results.md section 11: what eviction does to long generations (h2o-mini eval generate), the built-in
# long-output prompts, on the default model (N = 512) and Gemma 3 270M (N = 256), policies at 128 tokens.
# Resumable (each point is appended to its .jsonl as it finishes).
#   python docs/results_tables.py docs/results generate     prints the tables
set -euo pipefail
out=${1:-docs/results}
h2o-mini eval generate --max-new-tokens 512 --budget 128 --policy local --policy heavy_hitter --policy h2o \
  --policy sinks --policy tova --policy scissorhands --policy snapkv --policy a2sf --policy vatp \
  --out "$out/generate_default_512.jsonl" --plot "$out/generate_default_512.png" --json > /dev/null
h2o-mini eval generate --model gemma3-270m --max-new-tokens 256 --budget 128 --policy local --policy h2o \
  --policy tova --policy a2sf --out "$out/generate_gemma3-270m_256.jsonl" --plot "$out/generate_gemma3-270m_256.png" \
  --json > /dev/null
