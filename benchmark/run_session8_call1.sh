#!/usr/bin/env bash
# Session 8, call 1 (one H200): where a Flash-dims step goes (issue 12's "explain the largest
# remaining gap with a profile"): bench_one_batch at Flash dims with 20 layers (release-format
# dummy weights), mixed 64 / 256 / 2048 / 4096 tokens and decode 1 / 64, each row followed by the
# 15 largest kernels of one eager step; then the FP4 MoE variants at 64-4096 tokens, for one EP-2
# shard (128 experts) and all 256 (the one-GPU case).
# Usage (repo root, GPU machine): OUT=/dir bash benchmark/run_session8_call1.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD/python:$PWD/sgl-kernel/python
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
bob="python -m sglang.bench_one_batch --model-path dsv4-flash --load-format dummy --num-layers 20
  --iters 3 --repeats 3 --warmup 2 --profile-kernels 15"
start=$(date +%s)
timeout 250 $bob --modes mixed --num-tokens 64 256 2048 4096 --result-file "$OUT/bob_flash20_mixed.json" \
  > "$OUT/bob_flash20_mixed.log" 2>&1
echo "== mixed rc $? in $(( $(date +%s) - start )) s"; grep -vE "^\s*$" "$OUT/bob_flash20_mixed.log" | tail -90
start=$(date +%s)
timeout 130 $bob --modes decode --num-tokens 1 64 --result-file "$OUT/bob_flash20_decode.json" \
  > "$OUT/bob_flash20_decode.log" 2>&1
echo "== decode rc $? in $(( $(date +%s) - start )) s"; grep -vE "^\s*$" "$OUT/bob_flash20_decode.log" | tail -45
start=$(date +%s)
timeout 150 python sgl-kernel/benchmark/bench_quant.py --only moe --moe-t 64 256 1024 4096 \
  --out "$OUT/moe.json" > "$OUT/moe.log" 2>&1
echo "== moe rc $? in $(( $(date +%s) - start )) s"; grep -E "moe_E|variant" "$OUT/moe.log" | cut -c1-160 | tail -80
