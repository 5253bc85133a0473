#!/usr/bin/env bash
# Session 5, second call on 2 x H200, after the merges (numpy host layouts, one warm-up per bucket,
# cuBLAS block-scaled FP8 linears, bf16 tensor cores for the fp32 GEMMs, candidates read from the page
# table, the grouped FP4 MoE variant). GPU 1: the gpu-marked tests (kernels first). GPU 0: dsv4-mini and
# flash-slice-fp8 bench_one_batch, the step profile, the GEMM and MoE kernel rows.
# Usage (repo root, GPU machine): OUT=/dir DSV4_REFERENCE_DIR=... bash benchmark/run_session5_call2.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD/python:$PWD/sgl-kernel/python
nvidia-smi --query-gpu=name,memory.total --format=csv
py="python -m pytest -v --timeout 200 -p no:cacheprovider -rfE"
(export CUDA_VISIBLE_DEVICES=1
 timeout 200 $py -m gpu sgl-kernel/tests test/registered/layers test/registered/model_executor \
   test/registered/attention > "$OUT/gpu_tests_kernels.log" 2>&1
 timeout 300 $py -m gpu test/registered/models test/registered/managers/test_overlap_schedule_model.py \
   test/registered/quantization test/registered/mem_cache > "$OUT/gpu_tests_models.log" 2>&1) &
tests=$!
export CUDA_VISIBLE_DEVICES=0
timeout 80 python -m sglang.bench_one_batch --model-path dsv4-mini --num-tokens 16 64 256 1024 4096 \
  --repeats 3 --result-file "$OUT/bob_mini.json" > "$OUT/bob_mini.log" 2>&1
timeout 110 python benchmark/profile_bcg_step.py --model-path dsv4-flash-slice-fp8 --num-tokens 4096 256 16 \
  --out "$OUT/profile_flash_slice" > "$OUT/profile_flash_slice.log" 2>&1
timeout 120 python -m sglang.bench_one_batch --model-path dsv4-flash-slice-fp8 --num-tokens 16 256 1024 4096 \
  --repeats 3 --result-file "$OUT/bob_flash_slice_fp8.json" > "$OUT/bob_flash_slice_fp8.log" 2>&1
timeout 90 python sgl-kernel/benchmark/bench_quant.py --quick --moe-t 16 2048 8192 --out "$OUT/quant_quick.json" \
  > "$OUT/bench_quant_quick.log" 2>&1
wait $tests
for f in gpu_tests_kernels gpu_tests_models; do echo "== $f"; grep -E "passed|failed" "$OUT/$f.log" | tail -1
  grep -E "^(FAILED|ERROR)" "$OUT/$f.log" | head -12; done
grep -E "128K prefill|host syncs" "$OUT/gpu_tests_models.log" | cut -c1-300
for f in bob_mini bob_flash_slice_fp8; do grep -A12 "^mode" "$OUT/$f.log"; done
grep -E "^==|metadata|total  " "$OUT/profile_flash_slice/profile_bcg_step.txt" | head -20
grep -E "cublas|grouped|faster" "$OUT/bench_quant_quick.log" | cut -c1-220 | head -30
