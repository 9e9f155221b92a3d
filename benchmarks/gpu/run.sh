#!/usr/bin/env bash
# The GPU check in one command (benchmarks/gpu/bench.py says what it measures):
#   bash benchmarks/gpu/run.sh                                 # on a GPU: benchmarks/results/gpu-DATE-GPU.json, < 8 min on one H200
#   bash benchmarks/gpu/run.sh --cpu-smoke --out /tmp/x.json   # the tiny CPU dry run of the same code
# It uses the environment scripts/bootstrap.sh makes (.venv, or $TRAINPIPE_VENV) and runs bootstrap.sh first only when
# that environment is missing (that install is not counted in the 8 minutes).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${TRAINPIPE_VENV:-$ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[gpu-check] no environment at $VENV: running scripts/bootstrap.sh dev"
  bash "$ROOT/scripts/bootstrap.sh" dev
fi
STARTED="$(date +%s)"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
cd "$ROOT"
exec "$VENV/bin/python" "$ROOT/benchmarks/gpu/bench.py" --started-at "$STARTED" "$@"
