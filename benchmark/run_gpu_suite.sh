#!/usr/bin/env bash
# One H200 session's GPU work: install, gpu-marked tests, the BCG microbenchmark.
# Usage (repo root, on the GPU machine): OUT=/some/dir bash benchmark/run_gpu_suite.sh [part]
# part: tests | bench | serve | kernels | all (default: tests+bench)
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
part=${1:-default}
# No network there: put the sources on the path instead of pip (which wants setuptools).
export PYTHONPATH=$PWD/python:$PWD/sgl-kernel/python${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
if [[ $part == tests || $part == default || $part == all ]]; then
  # Every gpu / multi_gpu test under TESTS (default: all of test/), named one per line (-v) so a
  # call that runs out of time still shows how far it got. On a fresh machine (cold Triton
  # cache) all 61 take about 12 minutes: give them two calls, e.g.
  # TESTS="test/registered/attention ... test/registered/models/test_dsv4_gpu.py" then the rest.
  timeout ${TESTS_TIMEOUT:-540} python -m pytest -v -m "gpu or multi_gpu" --timeout 300 -p no:cacheprovider \
    --continue-on-collection-errors -rfEs --tb=short --durations=10 ${TESTS:-test} \
    > "$OUT/gpu_tests.log" 2>&1
  grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$OUT/gpu_tests.log" | cut -c1-200 | tail -70
fi
if [[ $part == bench || $part == default || $part == all ]]; then
  timeout 240 python -m sglang.bench_one_batch --model-path dsv4-mini \
    --num-tokens 16 64 256 512 1024 2048 4096 --result-file "$OUT/bench_one_batch.json" \
    2>&1 | tee "$OUT/bench_one_batch.log" | grep -v "it/s\]"
  timeout 120 python benchmark/profile_bcg_step.py --num-tokens 64 256 --out "$OUT" > "$OUT/profile.log" 2>&1
  grep -A6 "host ms" "$OUT/profile.log"
fi
if [[ $part == serve || $part == all ]]; then
  for bcg in "" "--enable-breakable-cuda-graph"; do
    timeout 280 python -m sglang.bench_offline_throughput --model-path dsv4-mini --num-prompts 256 \
      --random-input-len 512 --random-output-len 128 --enable-mixed-chunk $bcg \
      --result-file "$OUT/offline.jsonl" 2>&1 | tail -25 | tee -a "$OUT/offline.log"
  done
fi
if [[ $part == kernels || $part == all ]]; then
  timeout 200 python -m pytest -q sgl-kernel/tests 2>&1 | tail -5 | tee "$OUT/kernel_tests.log"
  timeout 200 python sgl-kernel/benchmark/run_all.py 2>&1 | tee "$OUT/kernel_bench.log" | tail -40
fi
