#!/usr/bin/env bash
# The Python environment the torchvision-dependent tests run trainpipe in: timm (`model.name_or_path: timm/NAME` or a timm
# folder) and the Qwen2-VL / SmolVLM (Idefics3) processors need torchvision, and PyPI's torchvision does not import beside
# the main environment's torch 2.13.0 CPU build ("operator torchvision::nms does not exist"). This one has torch 2.14.1 +
# torchvision 0.29.1 (a CUDA build, ~5.5 GB, that runs on the CPU; x86-64, Python 3.11), timm, Pillow, num2words (SmolVLM's
# processor imports it) and trainpipe's own dependencies, every package at the version in scripts/constraints-vision.txt
# (scripts/constraints.txt with torch and torchvision changed). trainpipe itself is not installed there (the environment is shared by every clone on a machine):
# run it with the clone's sources on the path, `PYTHONPATH=SRC "$PY" -m trainpipe.cli ...`.
# Idempotent: an environment made from the same pins and requirements (its .pins stamp) that imports torchvision and timm
# is reused. Prints the interpreter's path as its last line.
#   bash scripts/vision_venv.sh                 # ~/.cache/trainpipe/vision-venv
#   TRAINPIPE_VISION_VENV=DIR bash scripts/vision_venv.sh
# Measured on the 2-core development machine: see docs/testing.md ("The vision environment").
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${TRAINPIPE_VISION_VENV:-$HOME/.cache/trainpipe/vision-venv}"
CONSTRAINTS="$ROOT/scripts/constraints-vision.txt"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
# trainpipe's own requirements (pyproject.toml's dependencies and the `timm` extra), read from the clone
mapfile -t REQS < <("$PY" - "$ROOT/pyproject.toml" <<'EOF'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
for r in ["torch==2.14.1", "torchvision==0.29.1", "num2words", *project["dependencies"], *project["optional-dependencies"]["timm"]]:
    print(r)
EOF
)
STAMP="$( { cat "$CONSTRAINTS"; printf '%s\n' "${REQS[@]}"; } | sha256sum | cut -c1-16)"
if [ -x "$VENV/bin/python" ] && [ "$(cat "$VENV/.pins" 2>/dev/null)" = "$STAMP" ] \
  && "$VENV/bin/python" -c 'import torchvision.ops, timm' >/dev/null 2>&1; then
  echo "$VENV/bin/python"
  exit 0
fi
start=$(date +%s)
echo "[vision-venv] creating $VENV (torch 2.14.1 + torchvision 0.29.1 + timm, scripts/constraints-vision.txt)" >&2
rm -rf "$VENV"  # an unfinished or outdated one: start again
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -c "$CONSTRAINTS" "${REQS[@]}" >&2
"$VENV/bin/python" -c 'import torch, torchvision.ops, timm, transformers; print(f"[vision-venv] torch {torch.__version__}, torchvision {torchvision.__version__}, timm {timm.__version__}, transformers {transformers.__version__}")' >&2
echo "$STAMP" > "$VENV/.pins"
echo "[vision-venv] made in $(( $(date +%s) - start )) s" >&2
echo "$VENV/bin/python"
