#!/usr/bin/env bash
# Session 4's last GPU call on 2 x H200, after the merges (transient break arguments, runner
# settings from ServerArgs, overlap scheduling on by default, the FP4 MoE gemv variant):
# GPU 0 times the FP4 MoE variants at decode sizes, then runs one shard of the gpu-marked
# tests; GPU 1 runs the other shard (the HTTP load test last); then the DP tests on both.
# Usage (repo root, GPU machine): OUT=/dir bash benchmark/run_session4_final.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD/python:$PWD/sgl-kernel/python
nvidia-smi --query-gpu=name,memory.total --format=csv
py="python -m pytest -v --timeout 200 --durations=15 -p no:cacheprovider"
(export CUDA_VISIBLE_DEVICES=0
 timeout 75 python sgl-kernel/benchmark/bench_quant.py --only moe --quick --moe-t 1 16 64 \
   --out "$OUT/moe_gemv.json" > "$OUT/moe_gemv.log" 2>&1
 timeout 250 $py -m gpu test/registered/model_executor test/registered/layers sgl-kernel/tests \
   test/registered/attention > "$OUT/gpu_tests_a.log" 2>&1) &
a=$!
CUDA_VISIBLE_DEVICES=1 timeout 325 $py -m gpu test/registered/managers test/registered/models \
  test/registered/quantization test/registered/mem_cache test/registered/entrypoints/test_http_load.py -s \
  > "$OUT/gpu_tests_b.log" 2>&1
wait $a
timeout 60 $py -m multi_gpu test/registered/dp > "$OUT/multi_gpu.log" 2>&1
grep -E "faster|gemv_release |fp8_release " "$OUT/moe_gemv.log" | cut -c1-200 | head -12
for f in gpu_tests_a gpu_tests_b multi_gpu; do echo "== $f"; grep -E "passed|failed" "$OUT/$f.log" | tail -1
  grep -E "^(FAILED|ERROR)" "$OUT/$f.log" | head -12; done
grep -E "round [0-9]+:|128K" "$OUT/gpu_tests_b.log" | cut -c1-250 | tail -4
