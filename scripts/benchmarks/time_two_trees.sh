#!/usr/bin/env bash
# Times the same commands on two checkouts of h2o-mini, alternately, so that both see the same machine: decode at
# batch 1 against transformers (bench --vs-hf), eval ppl with full and with h2o at 0.1 of 2048 tokens of the GPL-3,
# and a batched sweep (every registered evicting policy at 0.1 of 1024 tokens, one pass). Default model, CPU.
#   git worktree add /tmp/before <commit>
#   scripts/benchmarks/time_two_trees.sh /tmp/before . [ROUNDS] > results/benchmarks/redesign_timings.jsonl
# One JSON line per (round, tree, command): decode tok/s (and transformers' in the same run), or wall seconds.
set -euo pipefail
old=$(cd "$1" && pwd); new=$(cd "$2" && pwd); rounds=${3:-2}
lic=/usr/share/common-licenses/GPL-3
policies=$(python -c "from h2o_mini.policies import REGISTRY; print(' '.join('--policy ' + n for n in REGISTRY if n != 'full'))")
run() {  # tree, label, command...: one JSON line with the wall time and the command's own last JSON line
  local tree=$1 label=$2; shift 2
  local t0 t1 last
  t0=$(date +%s.%N)
  last=$(cd / && PYTHONPATH="$tree" python -m h2o_mini "$@" 2>/dev/null | tail -n 1)  # from /: -m puts the cwd first
  t1=$(date +%s.%N)
  python - "$tree" "$label" "$t0" "$t1" "$last" <<'EOF'
import json, sys
tree, label, t0, t1, last = sys.argv[1:]
row = {"tree": tree, "command": label, "wall_s": round(float(t1) - float(t0), 2)}
try:
    out = json.loads(last)
    row.update({k: out[k] for k in ("decode_tok_s", "hf_decode_tok_s", "seconds") if k in out})
except ValueError:
    pass
print(json.dumps(row), flush=True)
EOF
}
for r in $(seq "$rounds"); do
  for tree in "$old" "$new"; do
    run "$tree" "bench batch 1 vs transformers" bench --policy full --prompt-tokens 128 --new-tokens 64 --vs-hf --json
    run "$tree" "eval ppl full 2048" eval ppl --text $lic --tokens 2048 --policy full --json
    run "$tree" "eval ppl h2o 0.1 2048" eval ppl --text $lic --tokens 2048 --policy h2o --budget 0.1 --json
    # shellcheck disable=SC2086
    run "$tree" "eval sweep ppl 14 policies 0.1 1024" eval sweep ppl --text $lic --tokens 1024 $policies --budget 0.1 --json
  done
done
