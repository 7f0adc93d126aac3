#!/usr/bin/env bash
# The kvpress peer check (docs/policies.md, "Checked against kvpress"): builds kvpress 0.5.5 a venv of its own
# (it needs transformers < 5.3; h2o-mini's tests use a newer one), then compares every shared press with
# h2o-mini's dense prefill on the default model and a tiny Qwen3. About 5 minutes on 2 cores, once the venv
# exists. Writes results/peers/kvpress_results.md. Not part of the test suite (building the venv is slow).
#   bash scripts/peers/run_kvpress.sh [VENV_DIR] [WORK_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
venv=${1:-${TMPDIR:-/tmp}/h2o-mini-kvpress}
work=${2:-${TMPDIR:-/tmp}/h2o-mini-kvpress-work}
if [ ! -x "$venv/bin/python" ]; then
  python -m venv "$venv"
  "$venv/bin/pip" install --quiet torch==2.13.0   # the CPU wheel where it is on disk; any torch elsewhere
  "$venv/bin/pip" install --quiet kvpress==0.5.5
fi
out=results/peers/kvpress_results.md
{
  echo "# h2o-mini beside kvpress $("$venv/bin/python" -c 'import kvpress, importlib.metadata as m; print(m.version("kvpress"))') (transformers $("$venv/bin/python" -c 'import transformers; print(transformers.__version__)'))"
  echo
  echo "Made by \`bash scripts/peers/run_kvpress.sh\` on $(date -u +%Y-%m-%d); read in docs/policies.md."
  echo
  python scripts/peers/kvpress_check.py "$venv/bin/python" "$work" 2>/dev/null
} > "$out.tmp"
mv "$out.tmp" "$out"
cat "$out"
