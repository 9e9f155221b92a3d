#!/usr/bin/env bash
# The Python environment AutoGluon runs in for `trainpipe automl --task tabular` (AutoGluon pins pandas below 2.4, trainpipe
# pandas 3, so it cannot share trainpipe's environment; trainpipe starts it as a subprocess). Idempotent: an environment
# that already has the pinned AutoGluon is reused. Prints the interpreter's path as its last line; name it in
# `automl.python` or $TRAINPIPE_AUTOML_PYTHON (the default is this script's default location).
#   bash scripts/automl_venv.sh            # ~/.cache/trainpipe/automl-venv
#   TRAINPIPE_AUTOML_VENV=DIR bash scripts/automl_venv.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${TRAINPIPE_AUTOML_VENV:-$HOME/.cache/trainpipe/automl-venv}"
CONSTRAINTS="$ROOT/scripts/constraints-automl.txt"
WANT="$(grep '^autogluon.tabular==' "$CONSTRAINTS" | cut -d= -f3)"
PY="${PYTHON:-python3}"
if [ -x "$VENV/bin/python" ] && [ "$("$VENV/bin/python" -c 'import autogluon.tabular, lightgbm; print(autogluon.tabular.__version__)' 2>/dev/null)" = "$WANT" ]; then
  echo "$VENV/bin/python"
  exit 0
fi
echo "[automl-venv] creating $VENV (AutoGluon $WANT, scripts/constraints-automl.txt)" >&2
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -c "$CONSTRAINTS" "autogluon.tabular[lightgbm]==$WANT" >&2
"$VENV/bin/python" -c 'import autogluon.tabular, lightgbm' >&2
echo "$VENV/bin/python"
