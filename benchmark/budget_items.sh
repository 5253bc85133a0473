# Sourced by the GPU drivers (run_session9.sh, run_flash_dp2_items.sh): run the items named on
# the command line in order while the call's time budget lasts. An item starts only if its usual
# time (NEED[item], seconds) fits in what is left, and gets what is left minus a margin. After
# each item any server or rank process it left behind is killed (a cut item can leave one
# holding the GPUs) and every log under $LOGS is packed into $OUT/$TARBALL, so a call cut short
# still returns what ran (a call returns at most 8 files).
# The driver sets LOGS, TARBALL, the associative array NEED and a function run_item ITEM SECONDS,
# then calls: budget_start DEFAULT_SECONDS; run_items "$@"
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD/python:$PWD/sgl-kernel/python

budget_start() { t0=$(date +%s); BUDGET=${BUDGET:-$1}; rm -rf "$LOGS"; mkdir -p "$LOGS"; }
left() { echo $(( BUDGET - ($(date +%s) - t0) )); }

run_items() {
  local item l s
  for item in "$@"; do
    l=$(left)
    if (( l < ${NEED[$item]:-60} )); then echo "== $item skipped: ${l} s left"; continue; fi
    s=$(date +%s)
    echo "== $item (at most $(( l - 8 )) s)"
    run_item "$item" $(( l - 8 ))
    pkill -9 -f "sglang\.(launch_server|bench_|srt)|multiprocessing.spawn" 2> /dev/null; sleep 1
    echo "== $item done in $(( $(date +%s) - s )) s"
    tar czf "$OUT/$TARBALL" -C "$LOGS" .
  done
  tar czf "$OUT/$TARBALL" -C "$LOGS" .
}
