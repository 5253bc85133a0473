#!/usr/bin/env bash
# Multi-turn chat sessions (bench_serving --dataset-name multi-turn: a shared system prompt, each
# turn's prompt the whole conversation so far) against one server per setting, measured the
# same way: per turn index TTFT, throughput and the server's cached tokens against what an ideal
# cache would hold, then a side-by-side table. Settings: on (prefix caching; under DP the default
# cache-aware routing), lpm (prefix caching, longest cached prefix admitted first),
# on_round_robin (prefix caching, round-robin routing), off.
# Default: full DeepSeek-V4-Flash (release-format dummy weights), breakable graphs, mixed chunks.
# Usage (repo root): OUT=/dir [MODEL=dsv4-flash] [NUM_LAYERS=N] [DP=1] [DEVICE=auto] \
#   [SETTINGS="on off"] [SESSIONS=32] [TURNS=4] [SYSTEM=1024] [TURN_IN=1024] [TURN_OUT=128] \
#   [CONCURRENCY=16] [EXTRA="--enable-breakable-cuda-graph --enable-mixed-chunk"] \
#   bash benchmark/serving/multi_turn_cache.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
MODEL=${MODEL:-dsv4-flash}; DP=${DP:-1}; DEVICE=${DEVICE:-auto}
SESSIONS=${SESSIONS:-32}; TURNS=${TURNS:-4}; SYSTEM=${SYSTEM:-1024}; TURN_IN=${TURN_IN:-1024}
TURN_OUT=${TURN_OUT:-128}; CONCURRENCY=${CONCURRENCY:-16}
EXTRA=${EXTRA---enable-breakable-cuda-graph --enable-mixed-chunk}
server_flags="--model-path $MODEL --load-format dummy --device $DEVICE $EXTRA"
[[ $DP != 1 ]] && server_flags="$server_flags --enable-dp-attention --dp-size $DP"
[[ -n ${NUM_LAYERS:-} ]] && server_flags="$server_flags --num-layers $NUM_LAYERS"
# the last turn's prompt and answer, rounded up to 1024
need=$(( SYSTEM + TURNS * (TURN_IN + TURN_OUT) )); ctx=$(( (need + 1023) / 1024 * 1024 ))
source "$(dirname "$0")/server.sh"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD/python:$PWD/sgl-kernel/python${PYTHONPATH:+:$PYTHONPATH}
port=30200
for setting in ${SETTINGS:-on off}; do
  case $setting in
    on) flags="" ;;  # prefix caching is on by default
    lpm) flags="--schedule-policy lpm" ;;
    on_round_robin) flags="--load-balance-method round_robin" ;;
    off) flags="--disable-radix-cache" ;;
    *) echo "unknown setting $setting (on, lpm, on_round_robin, off)"; exit 2 ;;
  esac
  if start_server "$setting" $port "$OUT/server_$setting.log" 200 $server_flags $flags --context-length $ctx; then
    python -m sglang.bench_serving --port $port --dataset-name multi-turn --num-sessions $SESSIONS \
      --num-turns $TURNS --system-prompt-len $SYSTEM --turn-input-len $TURN_IN --turn-output-len $TURN_OUT \
      --max-concurrency $CONCURRENCY --warmup-requests 2 --random-input-len 256 --tag $setting \
      --output-file "$OUT/multi_turn.jsonl" > "$OUT/multi_turn_$setting.log" 2>&1
    echo "rc=$?"; sed -n '/Per turn/,$p' "$OUT/multi_turn_$setting.log"
    curl -s "http://127.0.0.1:$port/get_server_info" > "$OUT/server_info_$setting.json"
  else
    tail -5 "$OUT/server_$setting.log"
  fi
  stop_server
  port=$(( port + 1 ))
done
python - "$OUT/multi_turn.jsonl" <<'PY'
import json, sys
try:
    runs = [json.loads(line) for line in open(sys.argv[1])]
except OSError as e:
    sys.exit(f"no results: {e}")
print(f"{'setting':<16}{'turn':>5}{'TTFT mean':>11}{'p50':>9}{'p99':>9}{'in tok/s':>11}{'out tok/s':>11}"
      f"{'cached':>9}{'shareable':>11}{'hit rate':>10}")
for run in runs:
    for r in run["turns"]:
        t = r["ttft_ms"]
        print(f"{run['args']['tag']:<16}{r['turn']:>5}{t['mean']:>11.1f}{t['p50']:>9.1f}{t['p99']:>9.1f}"
              f"{r['input_throughput']:>11.0f}{r['output_throughput']:>11.1f}{r['cached_tokens']:>9}"
              f"{r['shareable_tokens']:>11}{r['hit_rate']:>10.1%}")
    print(f"{run['args']['tag']:<16}{'all':>5}{run['ttft_ms']['mean']:>11.1f}{run['ttft_ms']['p50']:>9.1f}"
          f"{run['ttft_ms']['p99']:>9.1f}{run['input_throughput']:>11.0f}{run['output_throughput']:>11.1f}"
          f"{run['total_cached_tokens']:>9}{run['total_shareable_tokens']:>11}{run['hit_rate']:>10.1%}"
          f"   duration {run['duration_s']:.1f} s")
PY
