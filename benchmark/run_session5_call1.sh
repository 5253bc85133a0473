#!/usr/bin/env bash
# Session 5, first call on 2 x H200. GPU 0: the overlap no-sync test alone (full traceback),
# the 128K test, probe_torch_gemm.py, a kernel profile of a Flash-width step, dsv4-mini
# bench_one_batch (issue 14's re-run). GPU 1: the HTTP load test.
# Usage (repo root, GPU machine): OUT=/dir bash benchmark/run_session5_call1.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD/python:$PWD/sgl-kernel/python
nvidia-smi --query-gpu=name,memory.total --format=csv
py="python -m pytest -v --timeout 400 -p no:cacheprovider -rA"
(CUDA_VISIBLE_DEVICES=1 timeout 470 $py -m gpu test/registered/entrypoints/test_http_load.py -s \
  > "$OUT/http_load.log" 2>&1) &
load=$!
export CUDA_VISIBLE_DEVICES=0
timeout 100 $py -m gpu --tb=long -x test/registered/managers/test_overlap_schedule_model.py \
  > "$OUT/overlap_tests.log" 2>&1
timeout 110 $py -m gpu test/registered/models/test_long_context_gpu.py -s > "$OUT/long_context.log" 2>&1
timeout 60 python benchmark/probe_torch_gemm.py > "$OUT/probe_torch_gemm.log" 2>&1
timeout 110 python benchmark/profile_bcg_step.py --model-path dsv4-flash-slice-fp8 --num-tokens 4096 256 \
  --out "$OUT/profile_flash_slice" > "$OUT/profile_flash_slice.log" 2>&1
timeout 80 python -m sglang.bench_one_batch --model-path dsv4-mini --num-tokens 16 64 256 1024 4096 \
  --repeats 3 --result-file "$OUT/bob_mini.json" > "$OUT/bob_mini.log" 2>&1
wait $load
for f in overlap_tests long_context http_load; do echo "== $f"; grep -E "passed|failed" "$OUT/$f.log" | tail -1
  grep -E "^(FAILED|ERROR)" "$OUT/$f.log" | head -5; done
grep -E "host syncs|\.py:[0-9]+: " "$OUT/overlap_tests.log" | head -14
grep -E "round [0-9]+:|replays|MiB" "$OUT/http_load.log" | cut -c1-200 | tail -6
cat "$OUT/probe_torch_gemm.log" | cut -c1-330
grep -vE "it/s\]" "$OUT/bob_mini.log" | tail -12
