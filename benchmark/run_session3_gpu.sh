#!/usr/bin/env bash
# One call on 2 x H200: GPU 1 runs every gpu-marked test (one line per test in the log, so a
# killed run still says what passed) while GPU 0 runs the benchmarks; then the DP multi_gpu test.
# Usage (repo root, GPU machine): OUT=/dir bash benchmark/run_session3_gpu.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD/python:$PWD/sgl-kernel/python
nvidia-smi --query-gpu=name,memory.total --format=csv
(CUDA_VISIBLE_DEVICES=1 timeout 420 python -m pytest -v -m gpu --timeout 150 -p no:cacheprovider \
  --ignore=test/registered/entrypoints --continue-on-collection-errors sgl-kernel/tests test/registered \
  > "$OUT/gpu_tests.log" 2>&1) &
tests=$!
export CUDA_VISIBLE_DEVICES=0
timeout 90 python sgl-kernel/benchmark/bench_quant.py --quick --out "$OUT/quant_quick.json" > "$OUT/bench_quant_quick.log" 2>&1
timeout 150 python -m sglang.bench_one_batch --model-path dsv4-mini --num-tokens 16 64 256 1024 4096 \
  --result-file "$OUT/bob_mini.json" > "$OUT/bob_mini.log" 2>&1
for m in dsv4-flash-slice dsv4-flash-slice-fp8; do
  timeout 120 python -m sglang.bench_one_batch --model-path $m --num-tokens 16 256 4096 --repeats 3 \
    --result-file "$OUT/bob_$m.json" > "$OUT/bob_$m.log" 2>&1
done
unset CUDA_VISIBLE_DEVICES
wait $tests
timeout 150 python -m pytest -q -m multi_gpu -rA -p no:cacheprovider test/registered/dp > "$OUT/multi_gpu.log" 2>&1
grep -E "passed|failed" "$OUT/gpu_tests.log" "$OUT/multi_gpu.log" | tail -3
grep -E "FAILED|ERROR" "$OUT/gpu_tests.log" | head -20
grep -vE "it/s\]" "$OUT/bob_mini.log" | tail -12
grep -h -A12 "^mode" "$OUT"/bob_dsv4-flash-slice*.log
tail -25 "$OUT/bench_quant_quick.log"
