#!/usr/bin/env bash
# Session 4's GPU calls on 2 x H200: GPU 1 runs every gpu-marked test while GPU 0 starts
# DeepSeek-V4-Flash at full dims with 20 layers (release-format dummy weights, plan vs
# measured, capture, graph memory) and times mixed batches with bench_one_batch.
# Usage (repo root, GPU machine): OUT=/dir bash benchmark/run_session4_gpu.sh
# (benchmark/flash_memory_probe.py gives the per-module peaks when the graph pool needs a look.)
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD/python:$PWD/sgl-kernel/python
nvidia-smi --query-gpu=name,memory.total --format=csv
(CUDA_VISIBLE_DEVICES=1 timeout 570 python -m pytest -v -m gpu --timeout 240 --durations=25 -p no:cacheprovider \
  --ignore=test/registered/entrypoints --continue-on-collection-errors sgl-kernel/tests test/registered \
  > "$OUT/gpu_tests.log" 2>&1) &
tests=$!
export CUDA_VISIBLE_DEVICES=0
timeout 240 python benchmark/flash_h200.py --num-layers 20 > "$OUT/flash_startup.log" 2>&1
grep -E "startup_h200|memory|Error" "$OUT/flash_startup.log" | cut -c1-1800 | tail -8
timeout 300 python -m sglang.bench_one_batch --model-path dsv4-flash --load-format dummy --num-layers 20 \
  --num-tokens 16 64 256 1024 4096 --modes mixed extend --iters 3 --repeats 3 --warmup 2 \
  --result-file "$OUT/bob_flash20.json" > "$OUT/bob_flash20.log" 2>&1
grep -vE "it/s\]" "$OUT/bob_flash20.log" | tail -14
wait $tests
grep -E "passed|failed" "$OUT/gpu_tests.log" | tail -2
grep -E "FAILED|ERROR" "$OUT/gpu_tests.log" | head -30
