#!/usr/bin/env bash
# Session 3's last GPU call on 2 x H200: GPU 1 runs every gpu-marked test (one line per test
# in the log) while GPU 0 starts DeepSeek-V4-Flash at full dims with 20 layers (release-format
# dummy weights, memory plan vs measured, capture) and times one mixed batch.
# Usage (repo root, GPU machine): OUT=/dir bash benchmark/run_final_gpu.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD/python:$PWD/sgl-kernel/python
nvidia-smi --query-gpu=name,memory.total --format=csv
(CUDA_VISIBLE_DEVICES=1 timeout 330 python -m pytest -v -m gpu --timeout 150 -p no:cacheprovider \
  --ignore=test/registered/entrypoints --continue-on-collection-errors sgl-kernel/tests test/registered \
  > "$OUT/gpu_tests.log" 2>&1) &
tests=$!
export CUDA_VISIBLE_DEVICES=0
timeout 200 python benchmark/flash_h200.py --num-layers 20 > "$OUT/flash_startup.log" 2>&1
grep -E "startup_h200|paper_plan|Error|error" "$OUT/flash_startup.log" | cut -c1-1500
timeout 120 python -m sglang.bench_one_batch --model-path dsv4-flash --load-format dummy --num-layers 20 \
  --num-tokens 64 1024 4096 --modes mixed --iters 3 --repeats 3 --warmup 2 \
  --result-file "$OUT/bob_flash20.json" > "$OUT/bob_flash20.log" 2>&1
grep -vE "it/s\]" "$OUT/bob_flash20.log" | tail -8
wait $tests
grep -E "passed|failed" "$OUT/gpu_tests.log" | tail -2
grep -E "FAILED|ERROR" "$OUT/gpu_tests.log" | head -20
