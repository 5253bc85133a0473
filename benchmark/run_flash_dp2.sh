#!/usr/bin/env bash
# Full-size DeepSeek-V4-Flash (43 layers, release-format dummy weights) on 2 x H200 with DP
# attention 2 + expert parallel 2: offline serving with breakable graphs, then eager.
# Each start logs its memory plan, capture time and graph pool per rank.
# Usage (repo root, on the 2-GPU machine): OUT=/dir PROMPTS=128 IN=1024 OUTLEN=32 bash benchmark/run_flash_dp2.sh
# Issue 16's protocol in 10-minute calls: PROMPTS=1024 OUTLEN=256 REPEATS=1 MODES=bcg LIMIT=560, then MODES=eager.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
PROMPTS=${PROMPTS:-128}; IN=${IN:-1024}; OUTLEN=${OUTLEN:-32}; REPEATS=${REPEATS:-2}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD/python:$PWD/sgl-kernel/python
nvidia-smi --query-gpu=name,memory.total --format=csv
common="--model-path dsv4-flash --load-format dummy --enable-dp-attention --dp-size 2 --enable-mixed-chunk
  --num-prompts $PROMPTS --random-input-len $IN --random-output-len $OUTLEN --warmup-prompts 32 --repeats $REPEATS
  --result-file $OUT/offline_flash_dp2.jsonl"
for mode in ${MODES:-bcg eager}; do
  flag=""; limit=${LIMIT:-230}
  [[ $mode == bcg ]] && flag="--enable-breakable-cuda-graph" && limit=${LIMIT:-320}
  start=$(date +%s)
  timeout $limit python -m sglang.bench_offline_throughput $common $flag > "$OUT/offline_$mode.log" 2>&1
  echo "== $mode: rc $? in $(( $(date +%s) - start )) s"
  grep -E "memory plan|memory measured|captured|request throughput|TPOT|TTFT|replayed|Error|error" "$OUT/offline_$mode.log" \
    | cut -c1-600 | tail -16
done
