#!/usr/bin/env bash
# The verl GRPO example's arms one after another on one host, then the per-step table.
#
# usage: benchmark/bench_verl_grpo.sh MODEL_DIR OUT_DIR [hydra overrides ...]
#   PYTHON (python3), GSM8K (a GSM8K .jsonl instead of the dataset package's), STEPS (30), ARMS ("plain eagle cotrain"), GPUS (2), FIXED_DRAFTER (the eagle arm's drafter;
#   default: the random-init drafter the co-training arm starts from)
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=$1 OUT=$2
shift 2
PY=${PYTHON:-python3} STEPS=${STEPS:-30} ARMS=${ARMS:-"plain eagle cotrain"} GPUS=${GPUS:-2}
mkdir -p "$OUT"
[ -f "$OUT/data/train.parquet" ] || $PY examples/verl/prepare_gsm8k.py --out "$OUT/data" ${GSM8K:+--source "$GSM8K"}
[ -d "$OUT/drafter_init" ] || $PY -m sglang_rl.drafter init --target "$MODEL" --out "$OUT/drafter_init"
for arm in $ARMS; do
  drafter=$OUT/drafter_init
  [ "$arm" = eagle ] && drafter=${FIXED_DRAFTER:-$OUT/drafter_init}
  echo "=== arm $arm: $(date -u +%FT%TZ)"
  VERL_FILE_LOGGER_ROOT=$OUT/logs $PY examples/verl/run_grpo.py --arm "$arm" --model-path "$MODEL" \
    --drafter-path "$drafter" --data-dir "$OUT/data" --steps "$STEPS" --gpus "$GPUS" "$@" \
    > "$OUT/$arm.log" 2>&1 || { echo "arm $arm failed:"; tail -40 "$OUT/$arm.log"; }
done
$PY benchmark/verl_grpo_table.py "$OUT/logs/sglang-rl-gsm8k" --samples-per-step $((64 * 8))
