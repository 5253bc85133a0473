#!/usr/bin/env bash
# Issue 16 on 2 x H200 (full DeepSeek-V4-Flash, 43 layers, release-format dummy weights, DP attention 2
# + EP 2): its measurements as items run in the order given while the call's time budget lasts. An
# item starts only if its usual time fits in what is left and is cut at what is left; every log goes
# into one tarball under $OUT (a call returns at most 8 files), rewritten after each item so a cut
# call still returns what ran.
# Usage (repo root, 2-GPU machine): OUT=/dir BUDGET=570 bash benchmark/run_flash_dp2_items.sh ITEM...
# Items (usual seconds; the first start on a fresh machine also pays the Triton compiles):
#   mgpu_tests                  the multi_gpu tests (dsv4-tiny, two ranks over NCCL)
#   offline_bcg, offline_eager  bench_offline_throughput, 1024 prompts of 1024 in / 256 out, mixed chunk
#                               (run_flash_dp2.sh; PROMPTS / OUTLEN override)
#   serving                     both servers, BCG then eager: start-up, 64 greedy requests with top-2
#                               logprobs (agreement), bench_serving c 1 / 16 / 64, graph counters
#   bob                         bench_one_batch mixed and extend at 16 / 256 / 4096 tokens per rank
#   bob_decode                  bench_one_batch decode at batch 1 / 64 per rank (decode graphs)
LOGS=/tmp/dp2_logs; TARBALL=dp2_logs.tgz
source "$(dirname "$0")/budget_items.sh"
budget_start 570
declare -A NEED=([mgpu_tests]=90 [offline_bcg]=420 [offline_eager]=420 [serving]=480 [bob]=300 [bob_decode]=150)
bob="python -m sglang.bench_one_batch --model-path dsv4-flash --load-format dummy --dp-size 2
  --iters 3 --repeats 3 --warmup 2"
run_item() {  # $1 item, $2 seconds it may take
  local lim=$2
  case $1 in
    mgpu_tests)
      timeout $lim python -m pytest -q -m multi_gpu -p no:cacheprovider --tb=short test/registered/dp \
        > "$LOGS/mgpu_tests.log" 2>&1
      echo "rc $?"; grep -E "passed|failed|Error|assert" "$LOGS/mgpu_tests.log" | cut -c1-200 | tail -10 ;;
    offline_bcg|offline_eager)
      OUT=$LOGS PROMPTS=${PROMPTS:-1024} OUTLEN=${OUTLEN:-256} REPEATS=1 MODES=${1#offline_} LIMIT=$lim \
        bash benchmark/run_flash_dp2.sh
      mv "$LOGS/offline_${1#offline_}.log" "$LOGS/offline_${1#offline_}_$(date +%H%M%S).log" ;;
    serving)
      OUT=$LOGS timeout $lim bash benchmark/run_flash_dp2_serving.sh
      cp /tmp/serving_*_c*.log "$LOGS/" 2> /dev/null ;;
    bob)
      timeout $lim $bob --modes mixed extend --num-tokens ${BOB_TOKENS:-16 256 4096} --profile-kernels 10 \
        --result-file "$LOGS/bob_dp2.json" > "$LOGS/bob_dp2.log" 2>&1
      echo "rc $?"; grep -vE "^\s*$|Warn|warn|it/s\]" "$LOGS/bob_dp2.log" | cut -c1-220 | tail -40 ;;
    bob_decode)
      timeout $lim $bob --modes decode --num-tokens ${BOB_DECODE:-1 64} --profile-kernels 8 \
        --result-file "$LOGS/bob_dp2_decode.json" > "$LOGS/bob_dp2_decode.log" 2>&1
      echo "rc $?"; grep -vE "^\s*$|Warn|warn|it/s\]" "$LOGS/bob_dp2_decode.log" | cut -c1-220 | tail -24 ;;
    *) echo "unknown item $1" ;;
  esac
}
nvidia-smi --query-gpu=index,name,memory.total,clocks.max.sm --format=csv,noheader
run_items "$@"
