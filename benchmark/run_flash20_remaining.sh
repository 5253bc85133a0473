#!/usr/bin/env bash
# Issue 12's remaining one-H200 measurements besides the offline runs (run_flash20_offline.sh,
# one mode per call) and bench_serving (DP=1 NUM_LAYERS=20 bash run_flash_dp2_serving.sh), in one
# call of about 8 minutes: bench_one_batch at Flash dims with 20 layers under session 8's
# defaults (mixed 2048 / 4096 and decode 1 / 64, with the kernel profile); the FP4 MoE variants
# at 64 / 256 / 1024 tokens with the bf16 decode's one-dot step beside them; the 128K-token
# prompt at Flash dims through chunked prefill with breakable graphs.
# Usage (repo root, GPU machine): OUT=/dir bash benchmark/run_flash20_remaining.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD/python:$PWD/sgl-kernel/python
bob="python -m sglang.bench_one_batch --model-path dsv4-flash --load-format dummy --num-layers 20
  --iters 3 --repeats 3 --warmup 2"
start=$(date +%s)
timeout 150 $bob --modes mixed --num-tokens 2048 4096 --profile-kernels 10 --result-file "$OUT/bob_mixed.json" \
  > "$OUT/bob_mixed.log" 2>&1
echo "== mixed rc $? in $(( $(date +%s) - start )) s"; grep -vE "^\s*$|Warn|warn" "$OUT/bob_mixed.log" | tail -30
start=$(date +%s)
timeout 120 $bob --modes decode --num-tokens 1 64 --profile-kernels 8 --result-file "$OUT/bob_decode.json" \
  > "$OUT/bob_decode.log" 2>&1
echo "== decode rc $? in $(( $(date +%s) - start )) s"; grep -vE "^\s*$|Warn|warn" "$OUT/bob_decode.log" | tail -24
start=$(date +%s)
timeout 90 python sgl-kernel/benchmark/bench_quant.py --only moe --quick --moe-t 64 256 1024 --out "$OUT/moe.json" \
  > "$OUT/moe.log" 2>&1
echo "== moe rc $? in $(( $(date +%s) - start )) s"; grep -E "moe_E|variant" "$OUT/moe.log" | cut -c1-150
start=$(date +%s)
DSV4_LONG_MODEL=dsv4-flash DSV4_LONG_NUM_LAYERS=20 timeout 150 python -m pytest -q -s -m gpu -p no:cacheprovider \
  test/registered/models/test_long_context_gpu.py > "$OUT/long_context.log" 2>&1
echo "== 128K rc $? in $(( $(date +%s) - start )) s"; grep -E "128K|MiB|passed|failed|Error|s for" "$OUT/long_context.log" | cut -c1-250 | tail -12
