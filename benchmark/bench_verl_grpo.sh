#!/usr/bin/env bash
# The verl GRPO example's arms on one host (one after another, or at once with ARM_GPUS), then the
# per-step table and the audit.
#
# usage: benchmark/bench_verl_grpo.sh MODEL_DIR OUT_DIR [hydra overrides ...]
#   BATCH (64 prompts per step), N (8 rollouts per prompt), PYTHON (python3), GSM8K (a GSM8K .jsonl instead of the dataset package's), STEPS (30),
#   ARMS ("plain eagle cotrain"), GPUS (2), FIXED_DRAFTER (the eagle arm's drafter; default: one
#   trained offline on the initial policy's rollouts of the train prompts, sampled at temperature 1
#   as verl samples them, for OFFLINE_BUDGET_S (600) seconds with benchmark/bench_cotrain.py, from
#   the random-init drafter the co-training arm starts from), SAMPLE_RATE (the share of rollouts
#   kept for the audit, 0.05), AUDIT (1; 0 skips the audit), CALIBRATION (the verifier's
#   calibration file), VERIFIER_ARGS (its other flags), ARM_GPUS (one GPU per arm, e.g. "0 1 2":
#   the offline drafter is trained first on the first of them, then the arms run at once, each on
#   its GPU with GPUS=1 and its own Ray cluster; default: one after another on every visible GPU),
#   COTRAIN_DRAFTER (the cotrain arm's first drafter: "init", the random-init one (default), or
#   "offline", the eagle arm's)
set -euo pipefail
if [ $# -lt 2 ] || [ "$1" = -h ] || [ "$1" = --help ]; then sed -n '2,16p' "$0" | cut -c3-; exit 0; fi
cd "$(dirname "$0")/.."
MODEL=$1 OUT=$2
shift 2
BATCH=${BATCH:-64} N=${N:-8} PY=${PYTHON:-python3} STEPS=${STEPS:-30} ARMS=${ARMS:-"plain eagle cotrain"} GPUS=${GPUS:-2}
[ -n "${SKIP_ARMS:-}" ] && ARMS=""  # the table and the audit of arms already run
mkdir -p "$OUT"
[ -f "$OUT/data/train.parquet" ] || $PY examples/verl/prepare_gsm8k.py --out "$OUT/data" ${GSM8K:+--source "$GSM8K"}
[ -d "$OUT/drafter_init" ] || $PY -m sglang_rl.drafter init --model-path "$MODEL" --out "$OUT/drafter_init"
case ${COTRAIN_DRAFTER:-init} in init|offline) ;; *) echo "COTRAIN_DRAFTER must be init or offline" >&2; exit 2;; esac
fixed_drafter=${FIXED_DRAFTER:-$OUT/drafter_offline}
# the offline drafter: the eagle arm serves it, and the cotrain arm starts from it with COTRAIN_DRAFTER=offline
if [[ ( " $ARMS " == *" eagle "* || ( " $ARMS " == *" cotrain "* && ${COTRAIN_DRAFTER:-init} == offline ) )
      && -z "${FIXED_DRAFTER:-}" && ! -d "$OUT/drafter_offline" ]]; then
  echo "=== offline drafter: $(date -u +%FT%TZ)"
  on_gpu=(); [ -z "${ARM_GPUS:-}" ] || on_gpu=(env "CUDA_VISIBLE_DEVICES=${ARM_GPUS%% *}")
  "${on_gpu[@]}" $PY benchmark/bench_cotrain.py train --model-path "$MODEL" --gsm8k "$OUT/data/train_prompts.jsonl" \
    --out "$OUT/offline" --tag offline --draft-init "$OUT/drafter_init" --held-out 64 --drift-rounds 0 \
    --budget-s "${OFFLINE_BUDGET_S:-600}" --samples-per-round 128 --steps 200 --lr 1e-3 --train-temperature 1 \
    --save-drafter "$OUT/drafter_offline" > "$OUT/offline.log" 2>&1 || tail -30 "$OUT/offline.log"
fi
if [ -n "${ARM_GPUS:-}" ]; then  # each arm on its own GPU, at once: this script again per arm
  read -r -a arms <<< "$ARMS"; read -r -a gpus <<< "$ARM_GPUS"
  [ ${#gpus[@]} -ge ${#arms[@]} ] || { echo "ARM_GPUS names ${#gpus[@]} GPUs for ${#arms[@]} arms" >&2; exit 2; }
  pids=()
  for i in "${!arms[@]}"; do
    CUDA_VISIBLE_DEVICES=${gpus[$i]} ARMS=${arms[$i]} GPUS=1 ARM_GPUS= AUDIT=0 NO_TABLE=1 \
      bash "$0" "$MODEL" "$OUT" "$@" > "$OUT/run_${arms[$i]}.log" 2>&1 &
    pids+=($!)
  done
  status=0
  for i in "${!pids[@]}"; do wait "${pids[$i]}" || { status=1; echo "arm ${arms[$i]} failed:"; tail -20 "$OUT/run_${arms[$i]}.log"; }; done
  SKIP_ARMS=1 ARM_GPUS= CUDA_VISIBLE_DEVICES=${gpus[0]} bash "$0" "$MODEL" "$OUT" "$@"  # the table and the audit
  exit $status
fi
for arm in $ARMS; do
  drafter=$OUT/drafter_init
  [ "$arm" = eagle ] && drafter=$fixed_drafter
  [ "$arm" = cotrain ] && [ "${COTRAIN_DRAFTER:-init}" = offline ] && drafter=$fixed_drafter
  echo "=== arm $arm: $(date -u +%FT%TZ)"
  VERL_FILE_LOGGER_ROOT=$OUT/logs $PY examples/verl/run_grpo.py --arm "$arm" --model-path "$MODEL" \
    --drafter-path "$drafter" --data-dir "$OUT/data" --steps "$STEPS" --gpus "$GPUS" \
    --rollout-sample-dir "$OUT/rollout_sample/$arm" --rollout-sample-rate "${SAMPLE_RATE:-0.05}" \
    data.train_batch_size="$BATCH" actor_rollout_ref.actor.ppo_mini_batch_size="$BATCH" \
    actor_rollout_ref.rollout.n="$N" "$@" \
    > "$OUT/$arm.log" 2>&1 || { echo "arm $arm failed:"; tail -40 "$OUT/$arm.log"; }
done
[ -n "${NO_TABLE:-}" ] && exit 0
$PY benchmark/verl_grpo_table.py "$OUT/logs/sglang-rl-gsm8k" --samples-per-step $((BATCH * N)) \
  $($PY -c "import matplotlib" 2>/dev/null && echo --png "$OUT/grpo.png") || echo "no table (see the arms' logs)"
# the audit: 256 random co-training rollouts on a separate verifier with calibrated bounds
if [ "${AUDIT:-1}" = 1 ] && [ -d "$OUT/rollout_sample/cotrain" ]; then
  $PY -m sglang.launch_server --model-path "$MODEL" --toploc-verification --port 31111 \
    --toploc-verification-calibration "${CALIBRATION:-docs/results/gpu_h200_smollm2_calibration.json}" \
    ${VERIFIER_ARGS:-} > "$OUT/verifier.log" 2>&1 &
  verifier=$!
  for _ in $(seq 120); do curl -sf localhost:31111/health >/dev/null && break; sleep 5; done
  $PY -m sglang_rl.integrations.verl.audit --server http://localhost:31111 \
    --sample-dir "$OUT/rollout_sample/cotrain" --count 256 | tail -20
  kill $verifier
fi
