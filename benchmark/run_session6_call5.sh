#!/usr/bin/env bash
# Session 6, last call on one H200: the GPU tests the three-launch indexer top-k touched, with the
# fixed tests (Triton-size head dim; the reference tie order routed past the Triton top-k).
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD/python:$PWD/sgl-kernel/python
timeout 200 python -m pytest -q --timeout 150 -p no:cacheprovider -rfE --tb=short \
  test/registered/layers/test_deterministic_topk.py sgl-kernel/tests/test_kernels_indexer.py \
  test/registered/models/test_dsv4_gpu.py -k "topk or tie or conformance or indexer" > "$OUT/gpu_tests.log" 2>&1
tail -2 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR) |^E  " "$OUT/gpu_tests.log" | cut -c1-250 | head -12
