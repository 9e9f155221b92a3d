#!/usr/bin/env bash
# Set everything up from nothing and run the quickstart: LoRA SFT of the shipped tiny base
# model on the shipped instruction data, with baseline and final evaluation and export.
# Extra arguments go to `trainpipe run`, e.g. `--set training.learning_rate=1e-3`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/bootstrap.sh"
# shellcheck disable=SC1091
. "${TRAINPIPE_VENV:-$ROOT/.venv}/bin/activate"
cd "$ROOT"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
trainpipe run examples/quickstart/run.yaml --overwrite "$@"
