#!/usr/bin/env bash
# Session 6, second call on one H200: the three-launch Triton indexer top-k. (1) its GPU tests,
# the deterministic top-k and CUDA conformance tests, the attention GPU tests; (2) bench_one_batch
# on dsv4-mini alone (issue 14's before/after: session 5 call 5 had extend 16 / 64 at BCG/ideal
# 2.01 / 1.87); (3) the profile's host µs per break at 16 tokens.
# Usage (repo root, GPU machine): OUT=/dir bash benchmark/run_session6_call2.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD/python:$PWD/sgl-kernel/python
timeout 240 python -m pytest -q --timeout 200 -p no:cacheprovider -rfE --tb=short \
  sgl-kernel/tests/test_kernels_indexer.py test/registered/layers/test_deterministic_topk.py \
  test/registered/models/test_dsv4_gpu.py test/registered/attention > "$OUT/gpu_tests.log" 2>&1
tail -2 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR) |^E  " "$OUT/gpu_tests.log" | cut -c1-250 | head -12
timeout 240 python -m sglang.bench_one_batch --model-path dsv4-mini --num-tokens 16 64 256 1024 4096 --modes extend mixed \
  --repeats 5 --result-file "$OUT/bob_mini.json" > "$OUT/bob_mini.log" 2>&1
grep -E "^(extend|mixed|mode) " "$OUT/bob_mini.log"; grep -E "Error" "$OUT/bob_mini.log" | tail -3
timeout 120 python benchmark/profile_bcg_step.py --model-path dsv4-mini --modes extend mixed --num-tokens 16 \
  --out "$OUT/profile_mini" > "$OUT/profile_mini.log" 2>&1
grep -A4 -E "^== .*(host ms per phase|per segment launch)" "$OUT/profile_mini/profile_bcg_step.txt" | grep -v "^--"
