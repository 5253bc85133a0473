#!/usr/bin/env bash
# Session 7, call 2 on one H200: every gpu-marked test under test/ (issue 14's "GPU suite passes",
# the CUDA conformance tests included; multi_gpu ones skip on one GPU).
# Usage (repo root, GPU machine): OUT=/dir bash benchmark/run_session7_call2.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD/python:$PWD/sgl-kernel/python
timeout 570 python -m pytest -q -m "gpu or multi_gpu" --timeout 300 -p no:cacheprovider --continue-on-collection-errors -rfEs --tb=short \
  --durations=15 test > "$OUT/gpu_tests.log" 2>&1
echo "pytest rc $?"
grep -E "passed|failed" "$OUT/gpu_tests.log" | tail -2; grep -E "^(FAILED|ERROR|SKIPPED) |^E  " "$OUT/gpu_tests.log" | cut -c1-250 | head -20
grep -A16 "slowest 15" "$OUT/gpu_tests.log"
