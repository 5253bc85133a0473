#!/usr/bin/env bash
# DeepSeek-V4-Flash dims on one H200 with as many layers as fit (default 20): memory plan,
# start-up (capture time, graph memory), bench_one_batch, and the 128K-token prompt.
# Weights are release-format `--load-format dummy` (FP8 linears, FP4 experts drawn on the device);
# a plan that does not fit stops start-up with the shortfall in GiB.
# Usage (repo root, on the GPU machine): OUT=/some/dir NUM_LAYERS=20 bash benchmark/run_flash_h200.sh
set -uo pipefail
OUT=${OUT:-/tmp/flash_h200}; mkdir -p "$OUT"
NUM_LAYERS=${NUM_LAYERS:-20}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export PYTHONPATH=$PWD/python:$PWD/sgl-kernel/python${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv | tee "$OUT/gpu.txt"
# 1. The plan on paper (also says how many Flash layers one H200 holds).
python benchmark/flash_h200.py --plan-only --num-layers "$NUM_LAYERS" | tee "$OUT/plan.jsonl"
# 2. Start-up: weights, KV pool, BCG + decode graph capture; the runner logs plan vs measured.
timeout 600 python benchmark/flash_h200.py --num-layers "$NUM_LAYERS" 2>&1 | tee "$OUT/startup.log" \
  | grep -E "memory plan|memory measured|captured|startup_h200|Error"
# 3. One batch, extend and mixed, 16 to 4096 tokens: eager, BCG, ideal.
timeout 600 python -m sglang.bench_one_batch --model-path dsv4-flash --load-format dummy --num-layers "$NUM_LAYERS" \
  --num-tokens 16 64 256 1024 2048 4096 --result-file "$OUT/bench_one_batch_flash.json" 2>&1 \
  | tee "$OUT/bench_one_batch.log" | grep -v "it/s\]"
# 4. The 128K prompt through chunked prefill with BCG (time, memory; replay vs eager).
DSV4_LONG_MODEL=dsv4-flash DSV4_LONG_NUM_LAYERS=$NUM_LAYERS timeout 600 python -m pytest -q -m gpu -s \
  test/registered/models/test_long_context_gpu.py 2>&1 | tee "$OUT/long_context.log" | grep -E "128K|passed|failed"
