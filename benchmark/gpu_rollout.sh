#!/usr/bin/env bash
# The RL-step rollout figures (bench_rollout.py) on one GPU, stage by stage; each stage is one call
# of at most 8 minutes and stops its servers when it ends (timeout: SIGTERM, the bench stops them).
#
#   bash benchmark/gpu_rollout.sh train          # co-train a SmolLM2 EAGLE drafter, save it   (~5 min)
#   bash benchmark/gpu_rollout.sh widen          # SmolLM2 and the drafter at the Llama-8B shape (~1 min)
#   bash benchmark/gpu_rollout.sh wide ARMS      # bench_rollout.py on the widened 8B model, ARMS e.g. plain,eagle
#   bash benchmark/gpu_rollout.sh small ARMS     # bench_rollout.py on SmolLM2 (default: all four arms)
#   bash benchmark/gpu_rollout.sh report         # one table per model from every run so far
#
# The drafter trains on GSM8K prompts 0..806 only (bench_cotrain.py train: 1024 rollouts at
# temperature 1.0, 128 per round, 200 steps of 16, lr 1e-3; greedy held-out acceptance on its last
# 64 after every round); bench_rollout.py measures on the last 512 (--pool), which it never saw.
#
# Environment: WORK (folders and results, default /tmp/rollout; results in $WORK/results, also copied to
# $OUT when set, e.g. a device run's output folder),
# PYTHON (default python), N prompts x G samples, MAX_NEW tokens (8B; MAX_NEW_SMALL for SmolLM2), STEPS per
# temperature, TEMPS,
# CALL_S (the time limit of one stage, default 470 s; CPU: 1500), SHAPE_FLAGS (the widened shape's flags).
# CPU=1 tries every stage on the CPU at a tiny size (float32, a small widened shape, 2 x 2 x 16).
set -euo pipefail

STAGE=${1:?usage: gpu_rollout.sh train|widen|wide ARMS|small ARMS|report}
ARMS=${2:-plain,eagle,switch,switch-cotrain}
HERE=$(cd "$(dirname "$0")" && pwd)
PYTHON=${PYTHON:-python}
WORK=${WORK:-/tmp/rollout}
RESULTS=$WORK/results
CALL_S=${CALL_S:-$([ "${CPU:-0}" = 1 ] && echo 1500 || echo 470)}  # a CPU try is slower: all arms in one go
mkdir -p "$WORK" "$RESULTS"
# every stage leaves the results so far in $OUT too
trap '[ -n "${OUT:-}" ] && [ "$OUT" != "$RESULTS" ] && cp -r "$RESULTS/." "$OUT/"' EXIT

if [ "${CPU:-0}" = 1 ]; then
  export SGLANG_USE_CPU_ENGINE=1
  N=${N:-2}; G=${G:-2}; MAX_NEW=${MAX_NEW:-16}; MAX_NEW_SMALL=${MAX_NEW_SMALL:-16}; STEPS=${STEPS:-2}; TEMPS=${TEMPS:-0.7}
  SHAPE_FLAGS=${SHAPE_FLAGS:---hidden-size 768 --num-heads 12 --num-kv-heads 4 --head-dim 128 --intermediate-size 1600 --num-layers 31 --dtype float32}
  TRAIN_FLAGS=(--cpu --held-out 2 --rollouts 4 --samples-per-round 2 --steps 3 --max-new-tokens 12 --soft-topk 64)
  BENCH_FLAGS=(--cpu --gap-s 120 --cotrain-flags "--drafter-cotrain --drafter-cotrain-samples-per-round 2
    --drafter-cotrain-steps 2 --drafter-cotrain-threads 1")
else
  # 8B shape, one H200: 512 responses of up to 1024 tokens per step (up to ~1.1M tokens of KV at
  # 128 KiB each would not fit next to the weights); the estimate is ~30-60 s per step, unmeasured.
  # SmolLM2 (23 KiB of KV per token): the full 2048
  N=${N:-64}; G=${G:-8}; MAX_NEW=${MAX_NEW:-1024}; MAX_NEW_SMALL=${MAX_NEW_SMALL:-2048}; STEPS=${STEPS:-2}; TEMPS=${TEMPS:-0.7 1.0}
  SHAPE_FLAGS=${SHAPE_FLAGS:---shape llama-8b}
  TRAIN_FLAGS=(--held-out 64 --rollouts 1024 --samples-per-round 128 --steps 200 --lr 1e-3 --max-new-tokens 256)
  BENCH_FLAGS=(--gap-s 60)
fi

SMALL=$($PYTHON -m sglang_rl.cli model)
run() { echo "+ $*" >&2; timeout --signal=TERM "$CALL_S" "$@"; }

bench() {  # bench MODEL DRAFTER TAG ARMS MAX_NEW
  # shellcheck disable=SC2086
  run "$PYTHON" "$HERE/bench_rollout.py" --model-path "$1" --drafter "$2" --arms "$4" --prompts "$N" --samples "$G" \
    --max-new-tokens "$5" --temperatures $TEMPS --steps "$STEPS" --budget-s $((CALL_S - 120)) --timeout 300 \
    "${BENCH_FLAGS[@]}" --out "$RESULTS/rollout_$3_${4//,/_}.json"
}

case "$STAGE" in
  train)
    # the prompts the measured steps never use: GSM8K 0..806 (bench_rollout.py --pool 512 takes the rest)
    head -n 807 "$($PYTHON -c 'from sglang_rl.datasets import gsm8k_path; print(gsm8k_path())')" > "$WORK/train.jsonl"
    run "$PYTHON" "$HERE/bench_cotrain.py" train --model-path "$SMALL" --gsm8k "$WORK/train.jsonl" "${TRAIN_FLAGS[@]}" \
      --train-temperature 1.0 --drift-rounds 0 --budget-s $((CALL_S - 90)) --out "$RESULTS" --tag rollout_drafter \
      --draft-init "$WORK/drafter-init" --save-drafter "$WORK/drafter-small"
    ;;
  widen)
    rm -rf "$WORK/wide" "$WORK/drafter-wide"
    # shellcheck disable=SC2086
    run "$PYTHON" -m sglang_rl.cli model --model-path "$SMALL" $SHAPE_FLAGS --out "$WORK/wide"
    run "$PYTHON" -m sglang_rl.cli drafter widen --drafter-path "$WORK/drafter-small" --model-path "$WORK/wide" \
      --out "$WORK/drafter-wide"
    ;;
  wide) bench "$WORK/wide" "$WORK/drafter-wide" wide "$ARMS" "$MAX_NEW" ;;
  small) bench "$SMALL" "$WORK/drafter-small" small "$ARMS" "$MAX_NEW_SMALL" ;;
  report)
    for tag in small wide; do
      files=$(ls "$RESULTS"/rollout_"$tag"_*.json 2>/dev/null || true)
      # shellcheck disable=SC2086
      if [ -n "$files" ]; then "$PYTHON" "$HERE/bench_rollout.py" --report $files; fi
    done
    ;;
  *) echo "unknown stage $STAGE" >&2; exit 2 ;;
esac
