#!/usr/bin/env bash
# Refresh scripts/constraints.txt: build a throwaway environment from nothing with the newest releases
# (TRAINPIPE_UNPINNED=1) and write down what it resolved (torch and trainpipe aside: bootstrap.sh pins torch itself).
# Then run the suite (`bash scripts/test.sh`) before committing the new file.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
TRAINPIPE_VENV="$TMP/venv" TRAINPIPE_UNPINNED=1 bash "$ROOT/scripts/bootstrap.sh" dev
{
  sed -n '/^#/p' "$ROOT/scripts/constraints.txt"
  "$TMP/venv/bin/python" -m pip freeze --exclude-editable | grep -v -E '^(torch|trainpipe)==|^-e |@ ' | sort -f
} > "$TMP/constraints.txt"
mv "$TMP/constraints.txt" "$ROOT/scripts/constraints.txt"
echo "[lock] wrote scripts/constraints.txt ($(grep -vc '^#' "$ROOT/scripts/constraints.txt") packages)"
