#!/usr/bin/env bash
# Check the baselines against kvpress and the papers' formulas (a second venv; not part of CI).
# Usage: bash scripts/check_references.sh [--prompts 4] [--budgets 128,512] [--venv .refvenv]
# (the reference venv defaults to .refvenv in the project, git-ignored; RIPPLEKV_REFVENV or --venv move it)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 exec "$PY" scripts/check_references.py "$@"
