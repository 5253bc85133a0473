#!/usr/bin/env bash
# Warm, repeated baselines of the landed code (issue 13's "honest benchmarks"): one GPU for
# bench_one_batch and offline serving, both GPUs for DP=2 offline serving.
# Usage (repo root, GPU machine): OUT=/some/dir bash benchmark/run_honest_baseline.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD/python:$PWD/sgl-kernel/python
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
CUDA_VISIBLE_DEVICES=0 timeout 200 python -m sglang.bench_one_batch --model-path dsv4-mini \
  --num-tokens 16 64 256 1024 4096 --result-file "$OUT/bob_mini.json" 2>&1 | grep -v "it/s\]" | tee "$OUT/bob_mini.log"
for bcg in "" "--enable-breakable-cuda-graph"; do
  CUDA_VISIBLE_DEVICES=0 timeout 120 python -m sglang.bench_offline_throughput --model-path dsv4-mini --num-prompts 256 \
    --random-input-len 512 --random-output-len 128 --enable-mixed-chunk $bcg \
    --result-file "$OUT/offline_mini.jsonl" 2>&1 | tail -11 | tee -a "$OUT/offline_mini.log"
done
if [[ $(nvidia-smi -L | wc -l) -ge 2 ]]; then
  for bcg in "" "--enable-breakable-cuda-graph"; do
    timeout 150 python -m sglang.bench_offline_throughput --model-path dsv4-mini --num-prompts 512 \
      --random-input-len 512 --random-output-len 128 --enable-mixed-chunk --enable-dp-attention --dp-size 2 $bcg \
      --result-file "$OUT/offline_mini_dp2.jsonl" 2>&1 | tail -12 | tee -a "$OUT/offline_mini_dp2.log"
  done
fi
CUDA_VISIBLE_DEVICES=0 timeout 200 python -m sglang.bench_one_batch --model-path dsv4-flash-slice \
  --num-tokens 16 64 256 1024 4096 --result-file "$OUT/bob_flash_slice.json" 2>&1 | grep -v "it/s\]" | tee "$OUT/bob_flash_slice.log"
