#!/usr/bin/env bash
# First call of the next session on one H200: what session 6 built without a GPU to measure it.
# (1) GPU tests of the one-launch step metadata, the indexer top-k, logprobs on CUDA;
# (2) profile_bcg_step on dsv4-mini at 16 tokens (metadata ms, host µs per break: session 6 had
#     0.57 ms and 130-365 µs before the one-launch metadata and the numpy host layout);
# (3) bench_one_batch dsv4-mini at 16 / 64 / 256 tokens (issue 14's before/after).
# (4) benchmark/bench_launch_overhead.py.
# Usage (repo root, GPU machine): OUT=/dir bash benchmark/run_session7_call1.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD/python:$PWD/sgl-kernel/python
timeout 200 python -m pytest -q --timeout 150 -p no:cacheprovider -rfE --tb=short \
  sgl-kernel/tests/test_kernels_metadata.py sgl-kernel/tests/test_kernels_indexer.py \
  test/registered/managers/test_logprobs.py test/registered/attention test/registered/layers/test_deterministic_topk.py \
  > "$OUT/gpu_tests.log" 2>&1
tail -2 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR) |^E  " "$OUT/gpu_tests.log" | cut -c1-250 | head -12
timeout 120 python benchmark/profile_bcg_step.py --model-path dsv4-mini --modes extend mixed --num-tokens 16 \
  --out "$OUT/profile_mini" > "$OUT/profile_mini.log" 2>&1
grep -A5 -E "^== .*(host ms per phase|per segment launch)" "$OUT/profile_mini/profile_bcg_step.txt" | grep -v "^--"
timeout 200 python -m sglang.bench_one_batch --model-path dsv4-mini --num-tokens 16 64 256 --modes extend mixed \
  --repeats 5 --result-file "$OUT/bob_mini.json" > "$OUT/bob_mini.log" 2>&1
grep -E "^(extend|mixed|mode) " "$OUT/bob_mini.log"
# (4) the host µs of each break piece: Triton's launch path vs the raw launcher, by arg count
timeout 120 python benchmark/bench_launch_overhead.py > "$OUT/launch_overhead.log" 2>&1
cat "$OUT/launch_overhead.log"
