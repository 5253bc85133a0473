#!/usr/bin/env bash
# The grouped FP4 MoE variant on one H200 (session 5, branch s5-34): its tests, the small ones
# compiled (fp32 on the GPU: the torch.mm loop, overlap on a side stream) and the gpu ones (Flash dims
# vs a torch emulation of its numerics and vs the bf16 variant, CUDA graph replay, the opt-in
# overlap), then bench_quant's MoE rows at large T beside bf16 / fp8 (grouped_* rows, the
# decode alone, G = 8 / 32, overlap), then the sm_90 compile report of its kernels.
# Usage (repo root, GPU machine): OUT=/dir bash benchmark/run_grouped_moe_h200.sh  (under 10 min)
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python:$PWD/sgl-kernel/python
nvidia-smi --query-gpu=name,memory.total --format=csv
timeout 240 python -m pytest -v --durations=10 -p no:cacheprovider \
  sgl-kernel/tests/test_kernels_fp4_moe.py -k "grouped or route_by" > "$OUT/grouped_gpu_tests.log" 2>&1
timeout 300 python sgl-kernel/benchmark/bench_quant.py --only moe --quick --moe-t 2048 4096 8192 \
  --out "$OUT/moe_grouped.json" > "$OUT/moe_grouped.log" 2>&1
timeout 90 python sgl-kernel/benchmark/bench_quant.py --compile-report --only moe \
  > "$OUT/moe_compile_report.log" 2>&1
echo "== gpu tests"; grep -E "passed|failed" "$OUT/grouped_gpu_tests.log" | tail -1
grep -E "^(FAILED|ERROR)|Error" "$OUT/grouped_gpu_tests.log" | head -12
echo "== bench"; grep -E "^moe |faster" "$OUT/moe_grouped.log" | cut -c1-150
grep -E "Error|Traceback" "$OUT/moe_grouped.log" | head -5
echo "== compile"; grep grouped "$OUT/moe_compile_report.log"
