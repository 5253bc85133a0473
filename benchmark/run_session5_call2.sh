#!/usr/bin/env bash
# Session 5, second call on 2 x H200, after the merges (numpy host layouts, one warm-up per bucket,
# cuBLAS block-scaled FP8 linears, bf16 tensor cores for the fp32 GEMMs, candidates read from the page
# table, the grouped FP4 MoE variant). GPU 1: every gpu-marked test (kernels first). GPU 0: which cuBLAS
# layouts this torch takes, dsv4-mini and flash-slice-fp8 bench_one_batch (decode too), the step
# profile, the grouped MoE rows, the tensor-core GEMM timings.
# Usage (repo root, GPU machine): OUT=/dir bash benchmark/run_session5_call2.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD/python:$PWD/sgl-kernel/python
nvidia-smi --query-gpu=name,memory.total --format=csv
py="python -m pytest -v --timeout 200 -p no:cacheprovider -rfE"
(export CUDA_VISIBLE_DEVICES=1
 timeout 230 $py -m gpu sgl-kernel/tests test/registered/layers test/registered/model_executor \
   test/registered/attention > "$OUT/gpu_tests_kernels.log" 2>&1
 timeout 290 $py -m gpu -s test/registered/models test/registered/managers/test_overlap_schedule_model.py \
   test/registered/quantization test/registered/mem_cache > "$OUT/gpu_tests_models.log" 2>&1) &
tests=$!
export CUDA_VISIBLE_DEVICES=0
timeout 30 python -c "import torch; from dsv4_kernels import fp8_scaled_mm as S; print('cublas block-scaled support', [(p, d, S.device_supports('cuda', d, p)) for p in (False, True) for d in (torch.bfloat16, torch.float16)], S.probe_failures())" > "$OUT/cublas_support.log" 2>&1
timeout 80 python -m sglang.bench_one_batch --model-path dsv4-mini --num-tokens 16 64 256 1024 4096 \
  --repeats 3 --result-file "$OUT/bob_mini.json" > "$OUT/bob_mini.log" 2>&1
timeout 90 python benchmark/profile_bcg_step.py --model-path dsv4-flash-slice-fp8 --num-tokens 4096 16 \
  --out "$OUT/profile_flash_slice" > "$OUT/profile_flash_slice.log" 2>&1
timeout 100 python -m sglang.bench_one_batch --model-path dsv4-flash-slice-fp8 --num-tokens 16 256 4096 \
  --repeats 3 --result-file "$OUT/bob_flash_slice_fp8.json" > "$OUT/bob_flash_slice_fp8.log" 2>&1
timeout 60 python -m sglang.bench_one_batch --model-path dsv4-flash-slice-fp8 --modes decode --num-tokens 1 16 64 \
  --repeats 3 --result-file "$OUT/bob_flash_slice_fp8_decode.json" > "$OUT/bob_flash_slice_fp8_decode.log" 2>&1
timeout 100 python sgl-kernel/benchmark/bench_quant.py --only moe --quick --moe-t 4096 \
  --out "$OUT/moe_grouped.json" > "$OUT/moe_grouped.log" 2>&1
timeout 60 python benchmark/bench_tensor_core_gemm.py --out "$OUT/bench_tensor_core_gemm.json" \
  > "$OUT/bench_tensor_core_gemm.log" 2>&1
wait $tests
cat "$OUT/cublas_support.log" | tail -2 | cut -c1-400
for f in gpu_tests_kernels gpu_tests_models; do echo "== $f"; grep -E "passed|failed" "$OUT/$f.log" | tail -1
  grep -E "^(FAILED|ERROR)" "$OUT/$f.log" | head -14; done
grep -E "128K prefill|host syncs" "$OUT/gpu_tests_models.log" | cut -c1-300
for f in bob_mini bob_flash_slice_fp8 bob_flash_slice_fp8_decode; do grep -A12 "^mode" "$OUT/$f.log"; grep -E "Error" "$OUT/$f.log" | tail -2; done
grep -E "^==|metadata|total  " "$OUT/profile_flash_slice/profile_bcg_step.txt" | head -20
grep -E "^moe |faster|Error" "$OUT/moe_grouped.log" | cut -c1-160 | head -24
tail -12 "$OUT/bench_tensor_core_gemm.log" | cut -c1-200
