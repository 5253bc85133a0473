#!/usr/bin/env bash
# The fp32 GEMMs on bf16 tensor cores on one H200 (~6 min): the gpu test (cuBLAS fp32-output
# GEMMs vs fp64, graph replay, dsv4-mini / -fp8 / flash-slice-fp8 logits vs the fp32 GEMMs),
# the per-op timing at Flash shapes, and the profile of a 4096-token mixed step of
# dsv4-flash-slice-fp8 to compare with benchmark/results/session5/call1_tests_probe/.
# Usage (repo root, GPU machine): OUT=/dir bash benchmark/run_tensor_core_gemm_h200.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python:$PWD/sgl-kernel/python
timeout 240 python -m pytest -v -s -p no:cacheprovider -m gpu test/registered/models/test_tensor_core_gemm_gpu.py \
  > "$OUT/tensor_core_gpu_test.log" 2>&1
timeout 120 python benchmark/bench_tensor_core_gemm.py --out "$OUT/bench_tensor_core_gemm.json" \
  > "$OUT/bench_tensor_core_gemm.log" 2>&1
timeout 200 python benchmark/profile_bcg_step.py --model-path dsv4-flash-slice-fp8 --num-tokens 4096 256 \
  --out "$OUT/profile" > "$OUT/profile_flash_slice_fp8.log" 2>&1
grep -E "passed|failed" "$OUT/tensor_core_gpu_test.log" | tail -1
grep -E "^(FAILED|ERROR)|CUDA\]" "$OUT/tensor_core_gpu_test.log" | cut -c1-250
cat "$OUT/bench_tensor_core_gemm.log"
grep -E "gemm_f32|aten::bmm|aten::mm |replay|total" "$OUT/profile_flash_slice_fp8.log" | cut -c1-200 | head -20
