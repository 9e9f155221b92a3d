#!/usr/bin/env bash
# Set everything up from nothing and run the whole test suite (the quickstart included).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/unit -x`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/bootstrap.sh" dev
# shellcheck disable=SC1091
. "${TRAINPIPE_VENV:-$ROOT/.venv}/bin/activate"
cd "$ROOT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python -m pytest "$@"
