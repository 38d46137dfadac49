#!/usr/bin/env bash
# The whole pipeline: profile -> allocate [-> DepthKV profile and allocation] [-> route] -> eval -> report,
# from one config file (configs/*.env).
# It builds into a staging directory (runs/.staging/NAME) and replaces OUT only when every stage
# succeeded, so an interrupted run never leaves OUT (the committed results/) half-written. The earlier
# OUT is then moved aside to runs/previous-*, never deleted. An interrupted run resumes from its
# staging directory: finished stages are skipped when made by the same command; eval resumes itself.
set -euo pipefail
cd "$(dirname "$0")/.."
config=${1:?usage: scripts/reproduce.sh configs/NAME.env}
# shellcheck disable=SC1090
source "$config"
# Pre-flight: the config's tasks, methods, budgets and the stages its methods need, all checked before the first
# stage (scripts/check_config.py reads the model's config, never its weights): a mistake is one `error:` line,
# exit 2, nothing built.
# shellcheck disable=SC1090
(set -a; source "$config"; exec .venv/bin/python scripts/check_config.py "$config") || exit 2
RKV=${RKV:-.venv/bin/ripplekv}
model_args=()
[ -n "${MODEL:-}" ] && model_args=(--model "$MODEL")
FINAL=$OUT
OUT="runs/.staging/$(basename "$FINAL")"
if [ -d "$OUT" ]; then
  echo "== resuming the interrupted run in $OUT (becomes $FINAL when it completes)"
else
  echo "== building in $OUT; $FINAL is replaced only when the whole pipeline succeeds"
fi
mkdir -p "$OUT"

# run_stage NAME MARKER_FILE COMMAND...: run unless MARKER_FILE exists and NAME's recorded command matches.
# Commands are recorded with FINAL in place of the staging path: that is where their outputs end up.
run_stage() {
  local name=$1 marker=$2; shift 2
  local record="$OUT/.$name.cmd" wanted
  wanted=$(printf '%q ' "$@")
  wanted=${wanted//"$OUT"/$FINAL}
  if [ -f "$marker" ] && [ -f "$record" ] && [ "$(cat "$record")" = "$wanted" ]; then
    echo "== $name: up to date ($marker), skipped"
    return
  fi
  echo "== $name: $wanted"
  local began=$SECONDS
  "$@"
  echo "$wanted" > "$record"
  stage_time "$name" $((SECONDS - began))
}

# stage_time NAME SECONDS: how long a stage took in this invocation, in OUT/stages.csv (the results page lists it;
# a resumed run appends, so a stage run twice shows both).
stage_time() {
  [ -f "$OUT/stages.csv" ] || echo "stage,seconds" > "$OUT/stages.csv"
  echo "$1,$2" >> "$OUT/stages.csv"
  echo "== $1 took $2 s"
}

# run_eval NAME TITLE COMMAND...: an eval always runs (it resumes itself); its command is recorded in
# .NAME.cmd, with FINAL in place of the staging path, for the results page.
run_eval() {
  local name=$1 title=$2 record; shift 2
  echo "== $title (resumes where it stopped): $*"
  local began=$SECONDS
  "$@"
  stage_time "$name" $((SECONDS - began))
  record=$(printf '%q ' "$@")
  echo "${record//"$OUT"/$FINAL}" > "$OUT/.$name.cmd"
}

start=$(date +%s)

# ---- Calibration, once per calibration draw (#42) ------------------------------------------------------------
# DRAWS (optional, default 1): the calibration split is dealt into DRAWS disjoint draws (sample i of every task
# goes to draw i mod DRAWS; none is an evaluation sample), and every calibrated method is calibrated on each:
# RippleKV's profile and ratio, DepthKV's task-drop profile and allocation, CompressKV's profile, the route.
# Draw 0 writes where a single draw always did (OUT/profile, OUT/allocation.csv, ...) and is what METHODS
# evaluates; draw d >= 1 writes into OUT/draws/dD/, its files named -dD (an eval label shows a file's name only),
# and is evaluated in OUT/eval-draws (below). The stages of one draw take the first N prompts of that draw, so
# they share prompts as a single draw always did; the placement study is draw 0's alone.
DRAWS=${DRAWS:-1}

# calibrate_draw D DIR: every configured calibration stage of draw D, into DIR (OUT for draw 0); for D >= 1
# the stage names and the files an eval reads end in -dD.
calibrate_draw() {
  local d=$1 dir=$2 tag="" placements=${PLACEMENTS:-0}
  local draw_args=()
  [ "$d" -gt 0 ] && tag="-d$d" && placements=0
  [ "$DRAWS" -gt 1 ] && draw_args=(--calib-draw "$d" --calib-draws "$DRAWS")
  run_stage "profile$tag" "$dir/profile/sensitivity.csv" \
    "$RKV" profile "${model_args[@]}" --calib-samples "$CALIB_SAMPLES" "${draw_args[@]}" --seeds "$SEEDS" --eta "$ETA" \
    --probe-tokens "$PROBE_TOKENS" --target-tokens "$TARGET_TOKENS" --out "$dir/profile"
  local ratio_args=() sweep_args=()
  for r in $RATIOS; do ratio_args+=(--ratio "$r"); done
  # the calibration options steer the choice among several ratios; allocate refuses them beside one ratio
  [ "${#ratio_args[@]}" -gt 2 ] && sweep_args=(--budget "$SWEEP_BUDGET" --calib-samples "$SWEEP_SAMPLES" "${draw_args[@]}")
  run_stage "allocate$tag" "$dir/allocation$tag.csv" \
    "$RKV" allocate "$dir/profile/sensitivity.csv" "${model_args[@]}" "${ratio_args[@]}" \
    "${sweep_args[@]}" --target-tokens "$TARGET_TOKENS" --out "$dir/allocation$tag.csv"
  # DepthKV (optional, EVICT_CALIB_SAMPLES): its sensitivity as published, the task-score drop with each layer
  # alone pruned by PRUNE_RATIO (profile --signal evict, --measure task-drop), budgets proportional to it; beside
  # it the signals that might predict the drop on the same samples (the eviction KL at SWEEP_BUDGET and InfoNCE).
  if [ -n "${EVICT_CALIB_SAMPLES:-}" ]; then
    run_stage "profile-evict$tag" "$dir/profile-evict/sensitivity.csv" \
      "$RKV" profile "${model_args[@]}" --signal evict --measure task-drop --prune-ratio "${PRUNE_RATIO:-0.6}" \
      --calib-samples "$EVICT_CALIB_SAMPLES" "${draw_args[@]}" --target-tokens "$TARGET_TOKENS" --out "$dir/profile-evict"
    local floor_args=()
    [ -n "${DEPTHKV_FLOOR:-}" ] && floor_args=(--floor "$DEPTHKV_FLOOR")
    run_stage "allocate-depthkv$tag" "$dir/depthkv$tag.csv" \
      "$RKV" allocate "$dir/profile-evict/sensitivity.csv" "${model_args[@]}" --map proportional "${floor_args[@]}" \
      --out "$dir/depthkv$tag.csv"
    run_stage "profile-evict-kl$tag" "$dir/profile-evict-kl/sensitivity.csv" \
      "$RKV" profile "${model_args[@]}" --signal evict --measure kl --evict-budget "$SWEEP_BUDGET" \
      --calib-samples "$EVICT_CALIB_SAMPLES" "${draw_args[@]}" --probe-tokens "$PROBE_TOKENS" \
      --target-tokens "$TARGET_TOKENS" --out "$dir/profile-evict-kl"
    run_stage "profile-infonce$tag" "$dir/profile-infonce/sensitivity.csv" \
      "$RKV" profile "${model_args[@]}" --signal infonce --calib-samples "$EVICT_CALIB_SAMPLES" "${draw_args[@]}" \
      --target-tokens "$TARGET_TOKENS" --out "$dir/profile-infonce"
  fi
  # CompressKV (optional, COMPRESSKV_CALIB_SAMPLES): its offline layer error profile from calibration prompts.
  if [ -n "${COMPRESSKV_CALIB_SAMPLES:-}" ]; then
    run_stage "compresskv-profile$tag" "$dir/compresskv$tag.csv" \
      .venv/bin/python scripts/compresskv_profile.py "${model_args[@]}" --calib-samples "$COMPRESSKV_CALIB_SAMPLES" \
      "${draw_args[@]}" --budget "$SWEEP_BUDGET" --target-tokens "$TARGET_TOKENS" --out "$dir/compresskv$tag.csv"
  fi
  # Routing (optional, ROUTE_CALIB_SAMPLES): a method per layer, and (draw 0) the placement study.
  if [ -n "${ROUTE_CALIB_SAMPLES:-}" ]; then
    run_stage "route$tag" "$dir/route/ROUTE.csv" \
      "$RKV" route "${model_args[@]}" --budget "$ROUTE_BUDGET" --calib-samples "$ROUTE_CALIB_SAMPLES" "${draw_args[@]}" \
      --placements "$placements" --placement-samples "${PLACEMENT_SAMPLES:-0}" --probe-tokens "$PROBE_TOKENS" \
      --target-tokens "$TARGET_TOKENS" --out "$dir/route"
    [ "$d" -gt 0 ] && cp "$dir/route/ROUTE.csv" "$dir/ROUTE$tag.csv"
  fi
  return 0
}

calibrate_draw 0 "$OUT"
for ((d = 1; d < DRAWS; d++)); do
  calibrate_draw "$d" "$OUT/draws/d$d"
done

# pooled NAME: the profile folder NAME of every draw, comma-joined (signal_vs_drop.py pools them).
pooled() {
  local list="$OUT/$1"
  for ((d = 1; d < DRAWS; d++)); do list+=",$OUT/draws/d$d/$1"; done
  printf '%s' "$list"
}
# ---- end of the calibration draws ----------------------------------------------------------------------------

# DepthKV (optional, EVICT_CALIB_SAMPLES): a `depthkv` in METHODS (and HEADLINE_METHODS) is evaluated with draw 0's
# allocation (its label names the file, depthkv.csv). How well each signal, and RippleKV's noise KL, ranks layers
# as the drop does, over every draw's prompts.
methods=$METHODS
headline_methods=${HEADLINE_METHODS:-}
if [ -n "${EVICT_CALIB_SAMPLES:-}" ]; then
  run_stage predictors "$OUT/predictors.csv" \
    .venv/bin/python scripts/signal_vs_drop.py "$(pooled profile-evict)" "$(pooled profile)" "$(pooled profile-evict-kl)" \
    "$(pooled profile-infonce)" --out "$OUT/predictors.csv"
  with_depthkv() { printf ',%s,' "$1" | sed "s|,depthkv:|,depthkv:allocation=$OUT/depthkv.csv:|; s|,depthkv,|,depthkv:allocation=$OUT/depthkv.csv,|; s|^,||; s|,\$||"; }
  methods=$(with_depthkv "$METHODS")
  [ -n "$headline_methods" ] && headline_methods=$(with_depthkv "$headline_methods")
fi

# CompressKV (optional): a `compresskv` in METHODS is evaluated with draw 0's profile (label: compresskv.csv).
if [ -n "${COMPRESSKV_CALIB_SAMPLES:-}" ]; then
  methods=$(printf ',%s,' "$methods" | sed "s|,compresskv:|,compresskv:profile=$OUT/compresskv.csv:|; s|,compresskv,|,compresskv:profile=$OUT/compresskv.csv,|; s|^,||; s|,\$||")
fi

# LU-KV (optional, LUKV_CALIB_SAMPLES): its head-budget curves profiled on calibration prompts at this run's prompt
# length (never the evaluated samples), one per scorer of the `lukv` specs in METHODS; each is then evaluated with
# its curve (label: curve-SCORER.csv). Without it, `lukv` on the bundled model reads the curves shipped with it.
# Measured smoke cost: LUKV_CALIB_SAMPLES=2 at TARGET_TOKENS=1200 (prompts of 1165-1200 tokens), both curves,
# 7.7 min wall with the model load, 140-262 s a prompt, on 2 cores shared with other jobs (load ~15).
if [ -n "${LUKV_CALIB_SAMPLES:-}" ]; then
  lukv_specs=$(printf '%s\n' "${methods//,/$'\n'}" | grep -E '^lukv(:|$)' | paste -sd, - || true)
  if [ -n "$lukv_specs" ]; then
    first_scorer=$(sed -n 's/^[^,]*:scorer=\([^:,]*\).*/\1/p' <<< "$lukv_specs")
    run_stage lukv-profile "$OUT/lukv/curve-${first_scorer:-lukv}.json" \
      .venv/bin/python scripts/lukv_profile.py "${model_args[@]}" --methods "$lukv_specs" \
      --calib-samples "$LUKV_CALIB_SAMPLES" --target-tokens "$TARGET_TOKENS" --out "$OUT/lukv"
    with_curve=()
    IFS=, read -ra listed <<< "$methods"
    for spec in "${listed[@]}"; do
      if [[ $spec =~ ^lukv(:|$) ]]; then
        scorer=$(sed -n 's/.*:scorer=\([^:]*\).*/\1/p' <<< "$spec")
        spec="$spec:curve=$OUT/lukv/curve-${scorer:-lukv}.csv"
      fi
      with_curve+=("$spec")
    done
    methods=$(IFS=,; echo "${with_curve[*]}")
  fi
fi

# Routing (optional): `routed` and `routed-ripplekv` in METHODS use draw 0's route.
route_args=()
[ -n "${ROUTE_CALIB_SAMPLES:-}" ] && route_args=(--route "$OUT/route/ROUTE.csv")

# ---- Baselines' knobs tuned on calibration prompts (#42; optional, TUNE) -------------------------------------
# TUNE: space-separated grids (`cake:tau1=0.5,1,2:tau2=0.5,1,2 pyramidkv:beta=5,10,20,40`): each method's knobs
# are chosen as RippleKV's ratio is, by teacher-forced KL at SWEEP_BUDGET on draw 0's SWEEP_SAMPLES prompts, the
# grid extended past an edge pick; the METHODS entry naming the method (`cake`) is then evaluated as tuned.
if [ -n "${TUNE:-}" ]; then
  read -r -a tune_grids <<< "$TUNE"
  tune_draw_args=()
  [ "$DRAWS" -gt 1 ] && tune_draw_args=(--calib-draw 0 --calib-draws "$DRAWS")
  run_stage tune "$OUT/tune.json" \
    "$RKV" tune "${tune_grids[@]}" "${model_args[@]}" --budget "$SWEEP_BUDGET" --calib-samples "$SWEEP_SAMPLES" \
    "${tune_draw_args[@]}" --target-tokens "$TARGET_TOKENS" --out "$OUT/tune.json"
  methods=$(.venv/bin/python scripts/calibration_draws.py tuned "$methods" "$OUT/tune.json")
fi
# ---- end of the tuned baselines ------------------------------------------------------------------------------

budget_args=()
for b in $BUDGETS; do budget_args+=(--budget "$b"); done
# TASKS (optional): the suite's tasks the evals run (default: all of them)
task_args=()
[ -n "${TASKS:-}" ] && task_args=(--tasks "$TASKS")
eval_cmd=("$RKV" eval "${model_args[@]}" --suite "$SUITE" "${task_args[@]}" "${budget_args[@]}" --methods "$methods" --limit "$LIMIT"
  --target-tokens "$TARGET_TOKENS" --allocation "$OUT/allocation.csv" "${route_args[@]}" --out "$OUT/eval")
run_eval eval "eval" "${eval_cmd[@]}"

# ---- The calibration draws' eval (#42; DRAWS > 1) ------------------------------------------------------------
# Every calibrated method of METHODS once more per draw d >= 1 (its files from OUT/draws/dD), on the same samples
# as eval, at DRAW_BUDGETS (default BUDGETS), into OUT/eval-draws; OUT/draws.csv says which label is which draw
# (draw 0's lines are eval's own), so the page sets each method's spread over draws beside its interval.
if [ "$DRAWS" -gt 1 ]; then
  draw_methods=$(.venv/bin/python scripts/calibration_draws.py variants "$methods" --root "$OUT" --draws "$DRAWS" \
    --allocation "$OUT/allocation.csv" ${ROUTE_CALIB_SAMPLES:+--route "$OUT/route/ROUTE.csv"} --table "$OUT/draws.csv")
  if [ -n "$draw_methods" ]; then
    draw_budget_args=()
    for b in ${DRAW_BUDGETS:-$BUDGETS}; do draw_budget_args+=(--budget "$b"); done
    draws_cmd=("$RKV" eval "${model_args[@]}" --suite "$SUITE" "${task_args[@]}" "${draw_budget_args[@]}"
      --methods "full,$draw_methods" --limit "$LIMIT" --target-tokens "$TARGET_TOKENS" --out "$OUT/eval-draws")
    run_eval eval-draws "eval, calibrated methods on calibration draws 1-$((DRAWS - 1))" "${draws_cmd[@]}"
    .venv/bin/python scripts/calibration_spread.py "$OUT"
  fi
fi
# ---- end of the calibration draws' eval ----------------------------------------------------------------------

# DepthKV's headline ratio (optional, HEADLINE_METHODS): budgets count entries, not a share of the prompt, so
# 60% pruned is B = (1 - PRUNE_RATIO) x TARGET_TOKENS, which the offline suite's prompts (built to TARGET_TOKENS,
# +-2%) turn into 60% +-1% pruned; into OUT/eval-headline.
if [ -n "$headline_methods" ]; then
  headline_budget=$(awk -v r="${PRUNE_RATIO:-0.6}" -v n="$TARGET_TOKENS" 'BEGIN { printf "%d", (1 - r) * n + 0.5 }')
  headline_cmd=("$RKV" eval "${model_args[@]}" --suite "$SUITE" "${task_args[@]}" --budget "$headline_budget" --methods "$headline_methods"
    --limit "${HEADLINE_LIMIT:-$LIMIT}" --target-tokens "$TARGET_TOKENS" --allocation "$OUT/allocation.csv"
    --out "$OUT/eval-headline")
  run_eval eval-headline "eval at DepthKV's headline ratio (B=$headline_budget)" "${headline_cmd[@]}"
fi

# Head-to-head comparisons (optional, COMPARE_METHODS): methods too costly for every eval sample and budget, on the
# first COMPARE_LIMIT per task at COMPARE_BUDGETS (default BUDGETS), into OUT/eval-compare (the page pairs them).
if [ -n "${COMPARE_METHODS:-}" ]; then
  compare_budget_args=()
  for b in ${COMPARE_BUDGETS:-$BUDGETS}; do compare_budget_args+=(--budget "$b"); done
  compare_cmd=("$RKV" eval "${model_args[@]}" --suite "$SUITE" "${task_args[@]}" "${compare_budget_args[@]}" --methods "$COMPARE_METHODS"
    --limit "${COMPARE_LIMIT:-$LIMIT}" --target-tokens "$TARGET_TOKENS" --out "$OUT/eval-compare")
  run_eval eval-compare "eval, head-to-head comparisons" "${compare_cmd[@]}"
fi

# The memory axis (optional, MEMORY_METHODS; #44): eviction, quantization and both at matched bytes (budget B =
# the bytes of B full-precision entries per layer and KV head), on the first MEMORY_LIMIT per task at MEMORY_BUDGETS
# (default BUDGETS), into OUT/eval-memory, whose report holds memory_axis.csv/.md/.png. Cost: as an eval of these
# methods (a quantized variant's build adds a bisection over its entry budget and a quantize-dequantize pass).
if [ -n "${MEMORY_METHODS:-}" ]; then
  memory_budget_args=()
  for b in ${MEMORY_BUDGETS:-$BUDGETS}; do memory_budget_args+=(--budget "$b"); done
  memory_cmd=("$RKV" eval "${model_args[@]}" --suite "$SUITE" "${task_args[@]}" "${memory_budget_args[@]}"
    --methods "$MEMORY_METHODS" --limit "${MEMORY_LIMIT:-$LIMIT}" --target-tokens "$TARGET_TOKENS"
    --allocation "$OUT/allocation.csv" --out "$OUT/eval-memory")
  run_eval eval-memory "eval, the memory axis" "${memory_cmd[@]}"
fi

# The context-only protocol (optional, CONTEXT_METHODS): the same samples' first CONTEXT_LIMIT per task.
if [ -n "${CONTEXT_METHODS:-}" ]; then
  context_budget_args=()
  for b in $CONTEXT_BUDGETS; do context_budget_args+=(--budget "$b"); done
  context_cmd=("$RKV" eval "${model_args[@]}" --suite "$SUITE" "${context_budget_args[@]}" --methods "$CONTEXT_METHODS"
    --limit "$CONTEXT_LIMIT" --target-tokens "$TARGET_TOKENS" --protocol context-only --allocation "$OUT/allocation.csv"
    --out "$OUT/eval-context-only")
  run_eval eval-context-only "eval, context-only protocol" "${context_cmd[@]}"
fi

# Long answers under decode budgets (optional, LONG_TASKS): LONG_METHODS on an opt-in long-answer task with
# --decode-budget prompt (decoded tokens on top of B) and total (B holds while the model writes), into
# OUT/long/prompt and OUT/long/total.
if [ -n "${LONG_TASKS:-}" ]; then
  long_budgets=()
  for b in $LONG_BUDGETS; do long_budgets+=(--budget "$b"); done
  for mode in prompt total; do
    long_cmd=("$RKV" eval "${model_args[@]}" --suite offline --tasks "$LONG_TASKS" "${long_budgets[@]}"
      --methods "$LONG_METHODS" --limit "$LONG_LIMIT" --target-tokens "$LONG_TARGET_TOKENS"
      --allocation "$OUT/allocation.csv" --decode-budget "$mode" --out "$OUT/long/$mode")
    run_eval "long-$mode" "long answers, --decode-budget $mode" "${long_cmd[@]}"
  done
fi

# ---- The needle heatmap (optional, NEEDLE_LENGTHS) ------------------------------------------------------------
# RULER's niah_single_2 with the needle at each depth in turn (niah_depths), NEEDLE_LIMIT samples at each of
# NEEDLE_LENGTHS (target tokens), NEEDLE_METHODS at NEEDLE_BUDGET: one eval run per length in OUT/needle/tokens-N
# (each resumes itself), then OUT/needle/needle.csv and needle_b<B>.png (accuracy and KL, a panel per method).
# Cost: sum(NEEDLE_LENGTHS) x NEEDLE_LIMIT prompt tokens prefilled, each decoding every method once.
if [ -n "${NEEDLE_LENGTHS:-}" ]; then
  needle_cmd=("$RKV" needle "${model_args[@]}" --lengths "${NEEDLE_LENGTHS// /,}" --limit "${NEEDLE_LIMIT:-11}"
    --budget "${NEEDLE_BUDGET:-128}" --methods "${NEEDLE_METHODS:-full,streamingllm,snapkv,pyramidkv,ripplekv}"
    --allocation "$OUT/allocation.csv" --out "$OUT/needle")
  run_eval needle "needle heatmap" "${needle_cmd[@]}"
fi
# ---------------------------------------------------------------------------------------------------------------

# ---- What other targets write into FINAL (optional, CARRY) -----------------------------------------------------
# CARRY: folders of FINAL that another target makes (`gemma3`: the second model, `make reproduce-gemma`); each is
# copied unchanged into the new OUT, so this run replaces only what it made and the page still pairs them.
for kept in ${CARRY:-}; do
  if [ -d "$FINAL/$kept" ] && [ ! -e "$OUT/$kept" ]; then
    cp -a "$FINAL/$kept" "$OUT/$kept"
    echo "== $kept: kept from $FINAL (made by another target)"
  fi
done
# ---------------------------------------------------------------------------------------------------------------

.venv/bin/python scripts/write_results_readme.py "$OUT" "$config" "$FINAL"
find "$OUT" -name .lock -type f -delete  # every stage's, the profiles' and the route's too
if [ -e "$FINAL" ]; then
  previous="runs/previous-$(basename "$FINAL")-$(date +%Y%m%d-%H%M%S)"
  mv "$FINAL" "$previous"
  echo "== earlier outputs of $FINAL moved to $previous"
fi
mkdir -p "$(dirname "$FINAL")"
mv "$OUT" "$FINAL"
echo "== done in $(( $(date +%s) - start ))s: see $FINAL/README.md"
