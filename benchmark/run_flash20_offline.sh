#!/usr/bin/env bash
# Issue 12's offline run: DeepSeek-V4-Flash dims with 20 layers on one H200 (release-format dummy
# weights), bench_offline_throughput eager vs BCG, >= 1024 prompts of 1024 in / 256 out, mixed chunk.
# One mode per 10-minute device call (each ~6-8 min at session-5 speeds):
#   OUT=/dir MODES=bcg bash benchmark/run_flash20_offline.sh     then MODES=eager
# PROMPTS / IN / OUTLEN / REPEATS / LIMIT override the protocol for a quick check.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
PROMPTS=${PROMPTS:-1024}; IN=${IN:-1024}; OUTLEN=${OUTLEN:-256}; REPEATS=${REPEATS:-1}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD/python:$PWD/sgl-kernel/python
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
common="--model-path dsv4-flash --load-format dummy --num-layers ${NUM_LAYERS:-20} --enable-mixed-chunk
  --num-prompts $PROMPTS --random-input-len $IN --random-output-len $OUTLEN --warmup-prompts 32 --repeats $REPEATS
  --result-file $OUT/offline_flash20.jsonl"
for mode in ${MODES:-bcg eager}; do
  flag=""; [[ $mode == bcg ]] && flag="--enable-breakable-cuda-graph"
  start=$(date +%s)
  timeout ${LIMIT:-560} python -m sglang.bench_offline_throughput $common $flag > "$OUT/offline_$mode.log" 2>&1
  echo "== $mode: rc $? in $(( $(date +%s) - start )) s"
  grep -E "memory plan|captured|request throughput|output token|TPOT|TTFT|replayed|Error|error" "$OUT/offline_$mode.log" \
    | cut -c1-500 | tail -14
done
