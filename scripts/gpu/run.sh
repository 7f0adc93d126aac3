#!/usr/bin/env bash
# Every GPU check and benchmark of h2o-mini in one run (about 10 minutes on one H200), results under OUT
# (default results/gpu):
#   (a) the parity tests (eviction against the naive reference, logits against transformers) on CUDA;
#   (b) the default model in bf16 with the compiled step and CUDA graphs: full vs h2o 0.2, batch 8,
#       decode rate, KV bytes and peak memory against context (512 .. 8192 tokens), table + plot;
#   (c) OPT-6.7B-shaped random weights, 2048 + 2048 tokens: full vs h2o 0.2 latency at one batch and
#       throughput at the largest batch each fits (scripts/gpu/opt_random.py);
#   (d) many policies as the rows of one batch against one after another, reading and writing
#       (scripts/benchmarks/batched_cost.py);
#   (e) the per-token eviction loop on CUDA (scripts/benchmarks/loop_ops.py): kernel launches per token and layer of the
#       stream loop, and the time of reading 2048 tokens split into forward, eviction and scoring, for h2o and
#       scissorhands (the costliest registered policy), eager and with the loop body compiled (--compile:
#       torch.compile fuses each token's body into a few kernels; the body has static shapes within a chunk,
#       so CUDA graphs could capture it too, which h2o-mini does not do yet).
# --dry-run: the same steps on CPU with tiny shapes (MODEL=a checkpoint folder; tests/test_bench.py runs it).
# PYTHON: the interpreter to use (default: python3 on PATH; the tests pass their own). Runs from the repository
# root whatever the caller's folder; a relative OUT is taken from the caller's folder.
set -euo pipefail
dry=0
if [ "${1:-}" = --dry-run ]; then dry=1; shift; fi
out=${1:-results/gpu}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/../.."
py=${PYTHON:-python3}
trap 'echo "scripts/gpu/run.sh: failed (exit $?) at line $LINENO; see $out" >&2' ERR
if [ $dry = 1 ]; then
  export H2O_MINI_TEST_DEVICE=cpu
  tests=(-k "decode_step_matches_reference and h2o and llama_gqa_tied")
  bench=(--model "${MODEL:-default}" --device cpu --dtype float32 --no-compile --batch 2 --new-tokens 4
         --prompt-tokens 16 --prompt-tokens 32)
else
  export H2O_MINI_TEST_DEVICE=cuda
  tests=()
  bench=(--model "${MODEL:-default}" --device cuda --dtype bfloat16 --compile --batch 8 --new-tokens 128
         --prompt-tokens 1024 --prompt-tokens 8064)  # 4 compilations of the whole step
fi
"$py" - <<'PY' > "$out/device.txt"
import torch
print(torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
PY
# (a)
"$py" -m pytest -q -p no:cacheprovider tests/test_eviction_parity.py tests/test_model_parity.py "${tests[@]}" \
  > "$out/parity.txt" 2>&1 || true
if ! grep -q " passed" "$out/parity.txt" || grep -q "failed\|error" "$out/parity.txt"; then
  tail -n 20 "$out/parity.txt" >&2
  exit 1
fi
# (c) before (b): its eager runs have a known cost, while (b) compiles the whole step four times
"$py" scripts/gpu/opt_random.py $([ $dry = 1 ] && echo --dry-run) "$out"
# (b)
"$py" -m h2o_mini bench "${bench[@]}" --policy full --policy h2o --budget 0.2 --same-prompt --json \
  --plot "$out/default_bf16.png" > "$out/default_bf16.jsonl"
# (d)
cost=(--device cuda)
if [ $dry = 1 ]; then cost=(--model "${MODEL:-default}" --device cpu --tokens 8 --new-tokens 2); fi
"$py" scripts/benchmarks/batched_cost.py "${cost[@]}" > "$out/batched_cost.txt"
# (e)
loop=(--device cuda --tokens 2048)
if [ $dry = 1 ]; then loop=(--model "${MODEL:-default}" --device cpu --tokens 64 --chunk 16); fi
"$py" scripts/benchmarks/loop_ops.py "${loop[@]}" h2o scissorhands > "$out/loop_ops.jsonl"
if [ $dry = 0 ]; then "$py" scripts/benchmarks/loop_ops.py "${loop[@]}" --compile h2o scissorhands >> "$out/loop_ops.jsonl"; fi
echo "wrote $out"
