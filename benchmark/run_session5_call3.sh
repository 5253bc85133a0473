#!/usr/bin/env bash
# Session 5, third call on 2 x H200: every gpu-marked test of the merged tree in two shards, one per GPU,
# each with room to finish (the second call's 230 / 290 s shards were cut before their summaries).
# Usage (repo root, GPU machine): OUT=/dir bash benchmark/run_session5_call3.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD/python:$PWD/sgl-kernel/python
py="python -m pytest -v --timeout 300 -p no:cacheprovider -rfE --tb=short --durations=12"
CUDA_VISIBLE_DEVICES=1 timeout 440 $py -m gpu sgl-kernel/tests test/registered/layers test/registered/model_executor \
  test/registered/attention > "$OUT/gpu_tests_kernels.log" 2>&1 &
k=$!
CUDA_VISIBLE_DEVICES=0 timeout 440 $py -m gpu -s test/registered/models test/registered/managers/test_overlap_schedule_model.py \
  test/registered/quantization test/registered/mem_cache > "$OUT/gpu_tests_models.log" 2>&1
wait $k
for f in gpu_tests_kernels gpu_tests_models; do echo "== $f: $(grep -c PASSED "$OUT/$f.log") PASSED lines"
  grep -E "^=+ .*(passed|failed|error)" "$OUT/$f.log" | tail -1
  grep -E "^(FAILED|ERROR) " "$OUT/$f.log" | cut -c1-300 | head -15; done
grep -hE "^E  " "$OUT"/gpu_tests_*.log | cut -c1-250 | head -30
grep -hE "128K prefill|CUDA\]|cos" "$OUT/gpu_tests_models.log" | cut -c1-250 | head -12
