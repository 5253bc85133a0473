#!/usr/bin/env bash
# Session 6, first call on one H200: (1) the corrected tensor-core GPU test and the CUDA
# conformance tests (issue 14), (2) the small-extend regression profiled on dsv4-mini with
# host µs per segment / break, the metadata cProfile and torch's sync debug mode (issues 13, 14),
# (3) what capturing flash-slice's default buckets costs, cold and warm, at 8K and 1M context (issue 13).
# Usage (repo root, GPU machine): OUT=/dir bash benchmark/run_session6_call1.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD/python:$PWD/sgl-kernel/python
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
timeout 200 python -m pytest -q --timeout 180 -p no:cacheprovider -rfE --tb=short -m gpu \
  test/registered/models/test_tensor_core_gemm_gpu.py test/registered/models/test_dsv4_gpu.py > "$OUT/gpu_tests.log" 2>&1
tail -3 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR) |^E  " "$OUT/gpu_tests.log" | cut -c1-250 | head -12
timeout 200 python benchmark/profile_bcg_step.py --model-path dsv4-mini --modes extend mixed --num-tokens 16 64 256 \
  --out "$OUT/profile_mini" > "$OUT/profile_mini.log" 2>&1
echo "profile rc=$?"
grep -A5 -E "^== .*(host ms per phase|per segment launch|synchronizing)" "$OUT/profile_mini/profile_bcg_step.txt" | grep -v "^--" | cut -c1-220
for ctx in 8192 8192 1048576; do
  timeout 150 python benchmark/capture_cost.py --model-path dsv4-flash-slice --context-length $ctx > "$OUT/capture_$ctx.log" 2>&1
  grep '"capture_cost"' "$OUT/capture_$ctx.log" | tee -a "$OUT/capture_cost.jsonl" | cut -c1-900
  grep -E "Error|error" "$OUT/capture_$ctx.log" | tail -3
done
