#!/usr/bin/env bash
# Issue 16's one-batch protocol: full DeepSeek-V4-Flash (43 layers, release-format dummy weights) on
# 2 x H200, DP attention 2 + EP 2, mixed and extend at 16 / 256 / 4096 tokens per rank: eager, BCG and
# the ideal graph (NCCL inside one CUDA graph), with the communication share of an eager step.
# First the multi_gpu test on dsv4-tiny (checks the NCCL kernel names the comm column counts).
# Usage (repo root, on the 2-GPU machine): OUT=/dir [TOKENS="16 256 4096"] [SKIP_TEST=1] [LIMIT=420] bash benchmark/run_flash_dp2_one_batch.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
TOKENS=${TOKENS:-16 256 4096}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD/python:$PWD/sgl-kernel/python
nvidia-smi --query-gpu=name,memory.total --format=csv
if [[ -z "${SKIP_TEST:-}" ]]; then
  timeout 150 python -m pytest -v -s -m multi_gpu -p no:cacheprovider --tb=short \
    test/registered/dp/test_bench_one_batch_dp.py > "$OUT/one_batch_dp_test.log" 2>&1
  echo "== multi_gpu test: rc $?"; grep -E "^(mode|extend|mixed)|passed|failed|Error" "$OUT/one_batch_dp_test.log" | tail -10
fi
start=$(date +%s)
timeout ${LIMIT:-420} python -m sglang.bench_one_batch --model-path dsv4-flash --load-format dummy --dp-size 2 \
  --num-tokens $TOKENS --modes mixed extend --iters 3 --repeats 3 --warmup 2 \
  --result-file "$OUT/one_batch_flash_dp2.json" > "$OUT/one_batch_flash_dp2.log" 2>&1
echo "== flash dp2 one batch: rc $? in $(( $(date +%s) - start )) s"
grep -vE "it/s\]|USDT|FutureWarning|return func" "$OUT/one_batch_flash_dp2.log" | cut -c1-300 | tail -20
