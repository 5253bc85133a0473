#!/usr/bin/env bash
# Session 7, last call on one H200 (about 9 minutes of device time were left):
# (1) bench_launch_overhead.py after the host-math and split-cap changes (call 1 is the before);
# (2) bench_one_batch dsv4-mini at 16 / 64 / 256 tokens (call 1 is the before);
# (3) issue 13's offline goal: dsv4-flash-slice, 256 prompts 512/128, mixed chunk, BCG vs eager,
#     each with and without overlap scheduling (warm-up pass + 3 timed runs inside the benchmark).
# Usage (repo root, GPU machine): OUT=/dir bash benchmark/run_session7_call4.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD/python:$PWD/sgl-kernel/python
timeout 45 python benchmark/bench_launch_overhead.py --iters 1000 --repeats 5 > "$OUT/launch_overhead.log" 2>&1
cat "$OUT/launch_overhead.log"
timeout 90 python -m sglang.bench_one_batch --model-path dsv4-mini --num-tokens 16 64 256 --modes extend mixed \
  --repeats 5 --result-file "$OUT/bob_mini.json" > "$OUT/bob_mini.log" 2>&1
grep -E "^(extend|mixed|mode) " "$OUT/bob_mini.log"
for run in "--enable-breakable-cuda-graph" "" "--enable-breakable-cuda-graph --disable-overlap-schedule" "--disable-overlap-schedule"; do
  echo "== flash-slice offline: ${run:-eager, overlap}"
  timeout 100 python -m sglang.bench_offline_throughput --model-path dsv4-flash-slice --num-prompts 256 \
    --random-input-len 512 --random-output-len 128 --enable-mixed-chunk $run \
    --result-file "$OUT/overlap_flash_slice.jsonl" >> "$OUT/overlap_flash_slice.log" 2>&1
  echo "rc $?"; tail -14 "$OUT/overlap_flash_slice.log" | grep -v "runner stats" | grep -E "completed|req/s|TTFT|TPOT|forwards|overlap sched|Error|error" | head -8
done
