#!/usr/bin/env bash
# One server per mode, with breakable graphs (bcg) and eager (decode graphs on in both), each
# measured the same way: start-up time, 64 greedy requests with top-2 logprobs (their BCG-vs-eager
# agreement), bench_serving at concurrency 1 / 16 / 64, and the server's graph counters
# (/get_server_info) after the load. Default: full DeepSeek-V4-Flash (release-format dummy
# weights) on 2 GPUs with DP attention 2 + expert parallel 2.
# Usage (repo root): OUT=/dir [MODEL=dsv4-flash] [DP=2] [NUM_LAYERS=N] [MODES="bcg eager"] \
#   [GREEDY=1] [IN=1024] [OUTLEN=128] bash benchmark/serving/serve_bcg_vs_eager.sh
# GREEDY=0 skips the greedy requests (nothing to compare them with when one mode runs).
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
IN=${IN:-1024}; OUTLEN=${OUTLEN:-128}; DP=${DP:-2}; MODEL=${MODEL:-dsv4-flash}
parallel="--enable-dp-attention --dp-size $DP"; [[ $DP == 1 ]] && parallel=""
[[ -n ${NUM_LAYERS:-} ]] && parallel="$parallel --num-layers $NUM_LAYERS"
source "$(dirname "$0")/server.sh"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD/python:$PWD/sgl-kernel/python${PYTHONPATH:+:$PYTHONPATH}
port=30100
for mode in ${MODES:-bcg eager}; do
  flag=""; [[ $mode == bcg ]] && flag="--enable-breakable-cuda-graph"
  if start_server "$mode" $port "$OUT/server_$mode.log" 120 --model-path $MODEL --load-format dummy $parallel \
    --enable-mixed-chunk $flag; then
    [[ ${GREEDY:-1} == 1 ]] && timeout 90 python benchmark/accuracy/greedy_agreement.py collect --port $port --num 64 --out "$OUT/greedy_$mode.json"
    for c in 1 16 64; do
      n=$(( c == 1 ? 4 : (c == 64 ? 64 : 2 * c) ))
      # one results file for both modes and every concurrency (rows carry the mode's tag)
      timeout 100 python -m sglang.bench_serving --port $port --num-prompts $n --max-concurrency $c \
        --random-input-len $IN --random-output-len $OUTLEN --warmup-requests 2 --tag $mode \
        --output-file "$OUT/serving.jsonl" > "$OUT/serving_${mode}_c$c.log" 2>&1
      echo "c=$c rc=$?"; grep -iE "throughput|TTFT|TPOT|ITL" "$OUT/serving_${mode}_c$c.log" | head -16
    done
    curl -s "http://127.0.0.1:$port/get_server_info" > "$OUT/server_info_$mode.json"
  fi
  stop_server
  grep -E "memory plan|captured|Error" "$OUT/server_$mode.log" | cut -c1-400 | tail -6
  port=$(( port + 1 ))
done
[[ -f $OUT/greedy_bcg.json && -f $OUT/greedy_eager.json ]] && \
  python benchmark/accuracy/greedy_agreement.py compare "$OUT/greedy_bcg.json" "$OUT/greedy_eager.json"
python - "$OUT" <<'PY'
import json, sys
for mode in ("bcg", "eager"):
    try:
        info = json.load(open(f"{sys.argv[1]}/server_info_{mode}.json"))
    except Exception as e:  # the server did not come up
        print(mode, "no server info:", e); continue
    st = info["scheduler_stats"]
    keys = {k: v for k, v in st.items() if k.startswith(("dp_", "num_forwards", "breakable_replays", "breakable_fallbacks",
                                                          "decode_graph_replays", "num_overlap"))}
    print(mode, json.dumps(keys, default=str)[:1500])
    if st.get("dp_extend_steps"):
        print(f"{mode}: extend/mixed DP steps replayed from breakable graphs "
              f"{st.get('dp_breakable_steps', 0) / st['dp_extend_steps']:.1%}")
PY
