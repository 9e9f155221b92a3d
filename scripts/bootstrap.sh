#!/usr/bin/env bash
# Set up trainpipe from nothing: a virtual environment (.venv, or $TRAINPIPE_VENV),
# PyTorch for this machine (the CPU build without a GPU, the regular build with one),
# and trainpipe itself (editable) with the extras named in $1 (e.g. "dev").
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${TRAINPIPE_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
EXTRAS="${1:-}"
TORCH_VERSION="2.13.0"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[bootstrap] creating virtual environment $VENV"
  "$PYTHON" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
export PIP_DISABLE_PIP_VERSION_CHECK=1

if python -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH_VERSION' else 1)" 2>/dev/null; then
  echo "[bootstrap] torch $TORCH_VERSION already installed"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "[bootstrap] GPU found: installing the regular torch==$TORCH_VERSION build"
  python -m pip install --quiet "torch==$TORCH_VERSION"
else
  echo "[bootstrap] no GPU: installing the CPU build of torch==$TORCH_VERSION"
  python -m pip install --quiet "torch==$TORCH_VERSION+cpu" 2>/dev/null \
    || python -m pip install --quiet "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu
fi

SPEC="$ROOT"
[ -n "$EXTRAS" ] && SPEC="$ROOT[$EXTRAS]"
# The versions the test suite last passed with (scripts/constraints.txt, refreshed by scripts/lock.sh): a release
# published after that cannot change what a fresh machine or CI installs. TRAINPIPE_UNPINNED=1 takes the newest.
CONSTRAINTS=(-c "$ROOT/scripts/constraints.txt")
if [ "${TRAINPIPE_UNPINNED:-0}" = 1 ]; then
  CONSTRAINTS=()
  echo "[bootstrap] TRAINPIPE_UNPINNED=1: newest releases, not scripts/constraints.txt"
fi
echo "[bootstrap] installing trainpipe ($SPEC)"
python -m pip install --quiet -e "$SPEC" "${CONSTRAINTS[@]}"
python -c "import trainpipe, torch, transformers, peft; print(f'[bootstrap] trainpipe {trainpipe.__version__}, torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}')"
if [[ ",$EXTRAS," == *",dev,"* ]]; then
  # torchtitan's config parser, for the test that `trainpipe launch --emit torchtitan` writes arguments torchtitan accepts:
  # installed without its requirements (they would add tensorboard, wandb, an older datasets); these pins are what its
  # ConfigManager and model registry import, none of them pins torch beyond the installed one
  python -m pip install --quiet --no-deps torchtitan==0.3.0 tyro==1.0.17 typeguard==4.6.1 spmd_types==0.2.3 torchdata==0.11.0 \
    torch_checkpointing==0.1.1 docstring_parser==0.18.0 einops==0.8.2
fi
