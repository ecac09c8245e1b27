#!/usr/bin/env bash
# One bench_toploc.py process per variant, with the TOPLOC ablation and the scheduler phase timing
# plugins on PYTHONPATH, then the phase table of all variants side by side.
#
#   benchmark/toploc_ablation/sweep.sh RESULTS_DIR "off on no_jobs ..." -- <bench_toploc.py arguments>
#
# `off` and `on` are bench_toploc.py's modes; any other name is an on run with
# SGLANG_RL_TOPLOC_ABLATION set to it (see toploc_ablation.py).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
results="$1"; variants="$2"; shift 2
[ "${1:-}" = "--" ] && shift
mkdir -p "$results"
dirs=()
for v in $variants; do
  mode=on; ablation=""
  case "$v" in off) mode=off ;; on) ;; *) ablation="$v" ;; esac
  echo "== variant $v"
  SGLANG_RL_TOPLOC_ABLATION="$ablation" SGLANG_RL_PHASE_TIMING_DIR="$results/phases_$v" \
    PYTHONPATH="${PYTHONPATH:-}:$here:$here/../scheduler_timing" \
    python3 "$here/../bench_toploc.py" "$@" --modes "$mode" 2>&1 | grep -E "RESULT|^\|" || true
  dirs+=("$results/phases_$v")
done
python3 "$here/../scheduler_timing/phase_timing.py" "${dirs[@]}"
