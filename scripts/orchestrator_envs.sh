#!/usr/bin/env bash
# The orchestrators' own virtual environments for tests/e2e/test_orchestrators.py: Airflow 3 and Prefect 3 each pin
# fastapi (and more) below trainpipe's own pins, so neither installs beside trainpipe. Each goes into
# .venv/orchestrators/<name> (ignored by git, kept between runs), every package at the version in
# scripts/constraints-<name>.txt; trainpipe is not installed there: the compiled DAG / flow runs the project venv's
# `python -m trainpipe.cli pipeline step ...` for each task. The tests call `<env>/bin/python -m airflow` / `<env>/bin/python`.
#   bash scripts/orchestrator_envs.sh [airflow] [prefect]     (default: both; an existing env is kept)
# Measured here (2 shared CPU cores): Airflow 160-300 s, Prefect 80-230 s the first time (less with pip's cache warm); nothing afterwards.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${TRAINPIPE_ORCHESTRATORS:-$ROOT/.venv/orchestrators}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
names=("$@")
[ "${#names[@]}" -gt 0 ] || names=(airflow prefect)
for name in "${names[@]}"; do
  case "$name" in
    airflow) reqs=("apache-airflow-core==3.1.8" "apache-airflow-task-sdk==1.1.8" "apache-airflow-providers-standard" "apache-airflow-providers-cncf-kubernetes"); probe=airflow ;;
    prefect) reqs=("prefect==3.9.1"); probe=prefect ;;
    *) echo "orchestrator_envs.sh: unknown orchestrator '$name' (airflow, prefect)" >&2; exit 2 ;;
  esac
  env="$DEST/$name"
  if [ -f "$env/.complete" ]; then
    echo "[orchestrators] $name: $env (kept)"
    continue
  fi
  start=$(date +%s)
  rm -rf "$env"  # an unfinished one (no .complete): start again
  "$PY" -m venv "$env"
  "$env/bin/pip" install -q --disable-pip-version-check -c "$ROOT/scripts/constraints-$name.txt" "${reqs[@]}"
  "$env/bin/python" -c "import $probe" >/dev/null 2>&1 || { echo "[orchestrators] $name: \`import $probe\` fails in $env" >&2; exit 1; }
  touch "$env/.complete"
  echo "[orchestrators] $name: $env ($(( $(date +%s) - start )) s)"
done
