#!/usr/bin/env bash
# Session 6, a last short call on one H200 (the device time left): the host phases of a 16-token
# dsv4-mini extend replay after the one-launch step metadata, the numpy host layout and the
# refresh plan; then the step-metadata kernel tests compiled on the GPU.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python:$PWD/sgl-kernel/python
timeout 110 python benchmark/profile_bcg_step.py --model-path dsv4-mini --modes extend --num-tokens 16 \
  --out "$OUT/profile_mini" > "$OUT/profile_mini.log" 2>&1
echo "profile rc=$?"
grep -A5 -E "^== .*(host ms per phase|per segment launch)" "$OUT/profile_mini/profile_bcg_step.txt" | grep -v "^--"
timeout 45 python -m pytest -q -p no:cacheprovider sgl-kernel/tests/test_kernels_metadata.py > "$OUT/metadata_tests.log" 2>&1
tail -1 "$OUT/metadata_tests.log"; grep -E "^(FAILED|ERROR) |^E  " "$OUT/metadata_tests.log" | head -5
