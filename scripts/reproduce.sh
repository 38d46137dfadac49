#!/usr/bin/env bash
# The whole pipeline: profile -> allocate -> eval -> report, from one config file (configs/*.env).
# A new run starts from scratch (earlier outputs are moved aside to runs/previous-*, never deleted).
# An interrupted run (OUT/.in-progress left behind) resumes: finished stages are skipped when made by
# the same command, and eval resumes by itself.
set -euo pipefail
cd "$(dirname "$0")/.."
config=${1:?usage: scripts/reproduce.sh configs/NAME.env}
# shellcheck disable=SC1090
source "$config"
RKV=${RKV:-.venv/bin/ripplekv}
model_args=()
[ -n "${MODEL:-}" ] && model_args=(--model "$MODEL")
if [ ! -f "$OUT/.in-progress" ] && [ -n "$(ls -A "$OUT" 2>/dev/null)" ]; then
  previous="runs/previous-$(basename "$OUT")-$(date +%Y%m%d-%H%M%S)"
  mkdir -p runs
  mv "$OUT" "$previous"
  echo "== earlier outputs of $OUT moved to $previous"
fi
mkdir -p "$OUT"
touch "$OUT/.in-progress"

# run_stage NAME MARKER_FILE COMMAND...: run unless MARKER_FILE exists and NAME's recorded command matches.
run_stage() {
  local name=$1 marker=$2; shift 2
  local record="$OUT/.$name.cmd" wanted
  wanted=$(printf '%q ' "$@")
  if [ -f "$marker" ] && [ -f "$record" ] && [ "$(cat "$record")" = "$wanted" ]; then
    echo "== $name: up to date ($marker), skipped"
    return
  fi
  echo "== $name: $wanted"
  "$@"
  echo "$wanted" > "$record"
}

start=$(date +%s)
run_stage profile "$OUT/profile/sensitivity.csv" \
  "$RKV" profile "${model_args[@]}" --calib-samples "$CALIB_SAMPLES" --seeds "$SEEDS" --eta "$ETA" \
  --probe-tokens "$PROBE_TOKENS" --target-tokens "$TARGET_TOKENS" --out "$OUT/profile"

ratio_args=()
for r in $RATIOS; do ratio_args+=(--ratio "$r"); done
run_stage allocate "$OUT/allocation.csv" \
  "$RKV" allocate "$OUT/profile/sensitivity.csv" "${model_args[@]}" "${ratio_args[@]}" \
  --budget "$SWEEP_BUDGET" --calib-samples "$SWEEP_SAMPLES" --target-tokens "$TARGET_TOKENS" --out "$OUT/allocation.csv"

budget_args=()
for b in $BUDGETS; do budget_args+=(--budget "$b"); done
eval_cmd=("$RKV" eval "${model_args[@]}" --suite "$SUITE" "${budget_args[@]}" --methods "$METHODS" --limit "$LIMIT"
  --target-tokens "$TARGET_TOKENS" --allocation "$OUT/allocation.csv" --out "$OUT/eval")
echo "== eval (resumes where it stopped): ${eval_cmd[*]}"
"${eval_cmd[@]}"
printf '%q ' "${eval_cmd[@]}" > "$OUT/.eval.cmd"

.venv/bin/python scripts/write_results_readme.py "$OUT" "$config"
rm -f "$OUT/.in-progress"
echo "== done in $(( $(date +%s) - start ))s: see $OUT/README.md"
