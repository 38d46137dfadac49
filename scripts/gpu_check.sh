#!/usr/bin/env bash
# The GPU check, one run of at most 10 minutes on an H200 (scripts/gpu_check.py says what it checks):
# writes $OUT/gpu_check.json (pass/fail of every check with its threshold) and prints one `gpu_check:` line.
# Without CUDA it says so in one line and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
[ -x .venv/bin/python ] && .venv/bin/python -c "import torch" 2>/dev/null && PY=.venv/bin/python
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
timeout 590 $PY scripts/gpu_check.py --out "$out/gpu_check.json" "$@" 2> "$out/gpu_check.log"
code=$?
[ $code -eq 124 ] && echo "gpu_check: FAIL, over 590 s (see $out/gpu_check.log)"
[ $code -ne 0 ] && [ $code -ne 1 ] && [ $code -ne 124 ] && echo "gpu_check: FAIL, exit $code: $(tail -n 1 "$out/gpu_check.log")"
exit $code
