#!/usr/bin/env bash
# Sessions 9-13 (one H200, Flash dims with 20 layers): issue 12's measurements, as items run
# in the order given while the call's time budget lasts. An item starts only if its usual time
# fits in what is left, and is cut at what is left; every log goes into one tarball under $OUT
# (a call returns at most 8 files), rewritten after each item so a cut call still returns it.
# Usage (repo root, GPU machine): OUT=/dir BUDGET=540 bash benchmark/run_session9.sh ITEM...
# Items (usual seconds on a warm Triton cache):
#   offline_bcg, offline_eager   run_flash20_offline.sh, 1024 prompts of 1024 in / 256 out
#   serving_bcg                  bench_serving at concurrency 1 / 16 / 64 (run_flash_dp2_serving.sh)
#   long128k                     the 128K-token prompt, chunked prefill with breakable graphs
#   bob_mixed, bob_decode        bench_one_batch mixed 2048 / 4096, decode 1 / 64, with profiles
#                                (BOB_MIXED / BOB_DECODE: other token counts)
#   moe                          bench_quant's FP4 MoE variants at 64 / 256 / 1024 / 4096 tokens
#   gpu_tests                    the GPU tests of code not yet run on a GPU (GPU_TESTS: paths,
#                                GPU_TESTS_K: a -k expression, GPU_MARK: a -m one, "" for all)
#   ncu                          Nsight Compute on the FP4 MoE kernels (gemv at 64, fp8 at 256, bf16 at 4096)
#   profile4                     one eager mixed step of 4 layers (PROFILE_TOKENS, 4096), every kernel
#   attribute                    attribute_kernels.py: that step's GPU time by module and torch op (ATTR_MODE)
#   sweep                        sweep_moe_tiles.py: the MoE's tiles against alternatives (SWEEP_T)
LOGS=/tmp/session9_logs; TARBALL=session9_logs.tgz
source "$(dirname "$0")/budget_items.sh"
budget_start 540
declare -A NEED=([offline_bcg]=330 [offline_eager]=360 [serving_bcg]=300 [long128k]=120
                 [bob_mixed]=110 [bob_decode]=90 [moe]=80 [gpu_tests]=60 [ncu]=100
                 [profile4]=70 [sweep]=120 [attribute]=60)
bob="python -m sglang.bench_one_batch --model-path dsv4-flash --load-format dummy --num-layers 20
  --iters 3 --repeats 3 --warmup 2"
run_item() {  # $1 item, $2 seconds it may take
  local lim=$2
  case $1 in
    offline_bcg|offline_eager)
      OUT=$LOGS MODES=${1#offline_} LIMIT=$lim bash benchmark/run_flash20_offline.sh ;;
    serving_bcg)
      OUT=$LOGS DP=1 NUM_LAYERS=20 MODES=bcg GREEDY=0 timeout $lim bash benchmark/run_flash_dp2_serving.sh
      cp /tmp/serving_bcg_c*.log "$LOGS/" 2> /dev/null ;;
    long128k)
      DSV4_LONG_MODEL=dsv4-flash DSV4_LONG_NUM_LAYERS=20 timeout $lim python -m pytest -q -s -m gpu \
        -p no:cacheprovider test/registered/models/test_long_context_gpu.py > "$LOGS/long_context.log" 2>&1
      echo "rc $?"; grep -E "128K|MiB|passed|failed|Error|s for" "$LOGS/long_context.log" | cut -c1-250 | tail -12 ;;
    bob_mixed)
      timeout $lim $bob --modes mixed --num-tokens ${BOB_MIXED:-2048 4096} --profile-kernels 10 \
        --result-file "$LOGS/bob_mixed.json" > "$LOGS/bob_mixed.log" 2>&1
      echo "rc $?"; grep -vE "^\s*$|Warn|warn" "$LOGS/bob_mixed.log" | cut -c1-220 | tail -30 ;;
    bob_decode)
      timeout $lim $bob --modes decode --num-tokens ${BOB_DECODE:-1 64} --profile-kernels 8 \
        --result-file "$LOGS/bob_decode.json" > "$LOGS/bob_decode.log" 2>&1
      echo "rc $?"; grep -vE "^\s*$|Warn|warn" "$LOGS/bob_decode.log" | cut -c1-220 | tail -24 ;;
    moe)
      timeout $lim python sgl-kernel/benchmark/bench_quant.py --only moe --quick --moe-t ${MOE_T:-64 256 1024 4096} \
        --out "$LOGS/moe.json" > "$LOGS/moe.log" 2>&1
      echo "rc $?"; grep -E "moe_E|variant" "$LOGS/moe.log" | cut -c1-160 ;;
    gpu_tests)
      timeout $lim python -m pytest -q -m "${GPU_MARK-gpu}" -p no:cacheprovider \
        ${GPU_TESTS:-"sgl-kernel/tests/test_kernels_fp8_gemm.py"} -k "${GPU_TESTS_K-grouped}" > "$LOGS/gpu_tests.log" 2>&1
      echo "rc $?"; grep -E "PASSED|FAILED|ERROR|passed|failed|Error|assert" "$LOGS/gpu_tests.log" | cut -c1-200 | tail -12 ;;
    ncu)  # the FP4 MoE kernels under Nsight Compute (counters on Firecracker machines only)
      local sec="--section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis
        --section LaunchStats --section ComputeWorkloadAnalysis"
      for spec in "gemv 64 _gemv_gate_up" "gemv 64 _gemv_down" "bf16 4096 _fp4_gate_up"; do
        set -- $spec
        timeout $(( lim / 4 )) ncu --clock-control none --kernel-name regex:$3 --launch-skip 1 --launch-count 1 $sec \
          python sgl-kernel/benchmark/ncu_fp4_moe.py --variant $1 --t $2 > "$LOGS/ncu_${1}_$2$3.log" 2>&1
        echo "ncu $spec rc $?"; grep -E "Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|Registers Per|Achieved Occupancy|Theoretical Occupancy|Stall|Issued Ipc" \
          "$LOGS/ncu_${1}_$2$3.log" | head -14
      done ;;
    profile4)  # one eager mixed step of 4 Flash layers, its whole kernel list
      timeout $lim python -m sglang.bench_one_batch --model-path dsv4-flash --load-format dummy --num-layers 4 \
        --iters 3 --repeats 3 --warmup 2 --modes mixed --num-tokens ${PROFILE_TOKENS:-4096} --profile-kernels 70 \
        --result-file "$LOGS/profile4.json" > "$LOGS/profile4.log" 2>&1
      echo "rc $?"; grep -E "^mixed|GPU kernels" "$LOGS/profile4.log" | cut -c1-160 ;;
    attribute)  # attribute_kernels.py: a 4-layer eager step's GPU time by module and torch op
      timeout $lim python benchmark/attribute_kernels.py --model-path dsv4-flash --load-format dummy --num-layers 4 \
        --modes ${ATTR_MODE:-mixed} --num-tokens ${PROFILE_TOKENS:-4096} --top 45 > "$LOGS/attribute.log" 2>&1
      echo "rc $?"; grep -vE "^\s*$|Warn|warn" "$LOGS/attribute.log" | cut -c1-200 | head -40 ;;
    sweep)  # sgl-kernel/benchmark/sweep_moe_tiles.py: moe_config's tiles against their alternatives
      timeout $lim python sgl-kernel/benchmark/sweep_moe_tiles.py ${SWEEP_T:-} --out "$LOGS/sweep.json" \
        > "$LOGS/sweep.log" 2>&1
      echo "rc $?"; tail -40 "$LOGS/sweep.log" | cut -c1-180 ;;
    *) echo "unknown item $1" ;;
  esac
}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
run_items "$@"
