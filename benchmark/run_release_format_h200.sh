#!/usr/bin/env bash
# Issue 11 on one H200: the gpu tests of the release format (kernels, loader, conformance on
# CUDA, FP8 KV cache), the quantized-kernel microbenchmarks, and one batch bf16 vs release format.
# Usage (repo root, GPU machine): OUT=/some/dir bash benchmark/run_release_format_h200.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD/python:$PWD/sgl-kernel/python
nvidia-smi --query-gpu=name,memory.total --format=csv
timeout 240 python -m pytest -q -m gpu -rA sgl-kernel/tests test/registered/quantization test/registered/models \
  test/registered/mem_cache 2>&1 | tee "$OUT/gpu_tests_release.log" | grep -E "passed|failed|FAILED|ERROR|Error" | tail -30
timeout 240 python sgl-kernel/benchmark/bench_quant.py --out "$OUT/quant_h200.json" > "$OUT/bench_quant.log" 2>&1
tail -60 "$OUT/bench_quant.log"
for m in dsv4-flash-slice dsv4-flash-slice-fp8; do
  timeout 150 python -m sglang.bench_one_batch --model-path $m --num-tokens 16 64 256 1024 4096 --repeats 3 \
    --result-file "$OUT/bob_$m.json" 2>&1 | grep -v "it/s\]" | tee "$OUT/bob_$m.log"
done
