#!/usr/bin/env bash
# Overlap scheduling on one H200 (issue 13): the gpu equivalence test, then offline serving
# with and without overlap, eager and breakable graphs, on dsv4-mini and dsv4-flash-slice
# (warm-up and 3 timed runs inside bench_offline_throughput; each line reports the overlap
# counters). Usage (repo root, GPU machine): OUT=/some/dir [MODELS=dsv4-mini] [SKIP_TEST=1] bash benchmark/run_overlap_h200.sh
# (one model per call keeps each call inside a 10-minute device command)
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD/python:$PWD/sgl-kernel/python
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
[[ -n "${SKIP_TEST:-}" ]] || CUDA_VISIBLE_DEVICES=0 timeout 300 python -m pytest -x -q -m gpu test/registered/managers/test_overlap_schedule_model.py \
  2>&1 | tail -5 | tee "$OUT/overlap_gpu_test.log"
for model in ${MODELS:-dsv4-mini dsv4-flash-slice}; do
  for bcg in "" "--enable-breakable-cuda-graph"; do
    for ov in "" "--disable-overlap-schedule"; do
      CUDA_VISIBLE_DEVICES=0 timeout 240 python -m sglang.bench_offline_throughput --model-path $model --num-prompts 256 \
        --random-input-len 512 --random-output-len 128 --enable-mixed-chunk $bcg $ov \
        --result-file "$OUT/overlap_$model.jsonl" 2>&1 | tail -12 | grep -v "runner stats" | tee -a "$OUT/overlap_$model.log"
    done
  done
done
