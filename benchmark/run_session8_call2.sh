#!/usr/bin/env bash
# Session 8, call 2 (one H200), after the fixes call 1's profile asked for (the grouped FP4 MoE
# from 2048 tokens, hc_pre in two launches): model-level GPU tests (CUDA conformance, the grouped
# MoE inside a breakable graph, the one-dot-per-step bf16 decode), the MoE variants around the
# new switch, and bench_one_batch at Flash dims with 20 layers again (mixed 2048 / 4096 with the
# kernel profile, decode 1 / 64).
# Usage (repo root, GPU machine): OUT=/dir bash benchmark/run_session8_call2.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD/python:$PWD/sgl-kernel/python
start=$(date +%s)
timeout 150 python -m pytest -q -v -m gpu -p no:cacheprovider -s \
  "test/registered/quantization/test_release_format_gpu.py::test_large_prefill_runs_the_grouped_fp4_moe_in_a_breakable_graph" \
  test/registered/models/test_dsv4_gpu.py::test_conformance_tiny_on_cuda_float32_matches_cpu \
  test/registered/models/test_dsv4_conformance_fp8fp4.py::test_cuda_float32_rows \
  "sgl-kernel/tests/test_kernels_fp4_moe.py::test_gpu_bf16_fp4_moe_at_flash_dims" -k "not fp8-True and not bf16-" \
  > "$OUT/tests.log" 2>&1
echo "== tests rc $? in $(( $(date +%s) - start )) s"
grep -E "PASSED|FAILED|ERROR|passed|failed|grouped MoE|Error" "$OUT/tests.log" | cut -c1-200 | tail -20
start=$(date +%s)
timeout 60 python sgl-kernel/benchmark/bench_quant.py --only moe --quick --moe-t 1536 4096 --out "$OUT/moe.json" > "$OUT/moe.log" 2>&1
echo "== moe rc $? in $(( $(date +%s) - start )) s"
grep -E "moe_E.* (fp8|bf16|grouped)_release(_step)? |variant" "$OUT/moe.log" | cut -c1-150
bob="python -m sglang.bench_one_batch --model-path dsv4-flash --load-format dummy --num-layers 20
  --iters 3 --repeats 3 --warmup 2"
start=$(date +%s)
timeout 150 $bob --modes mixed --num-tokens 2048 4096 --profile-kernels 10 --result-file "$OUT/bob_mixed.json" \
  > "$OUT/bob_mixed.log" 2>&1
echo "== mixed rc $? in $(( $(date +%s) - start )) s"; grep -vE "^\s*$|Warn|warn" "$OUT/bob_mixed.log" | tail -32
start=$(date +%s)
timeout 75 $bob --modes decode --num-tokens 1 64 --profile-kernels 5 --result-file "$OUT/bob_decode.json" \
  > "$OUT/bob_decode.log" 2>&1
echo "== decode rc $? in $(( $(date +%s) - start )) s"; grep -vE "^\s*$|Warn|warn" "$OUT/bob_decode.log" | tail -16
