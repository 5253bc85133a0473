#!/usr/bin/env bash
# MTP speculative decoding against plain decoding, one server per setting, each measured the
# same way: bench_serving at each concurrency and output length (TPOT, output throughput) and
# the server's speculation counters. Random weights accept almost no draft, so the speculative
# settings pin a mean accepted length with SGLANG_SIMULATE_ACCEPT_LENGTH (drafting and
# verification cost what they really cost; the tokens are not the model's).
# Settings: off, and k<steps>a<accepted>[e] (e.g. k3a2: 3 drafts, 2 accepted per step on
# average; a trailing e runs without any graph: eager verify, eager MTP layer).
# Default: DeepSeek-V4-Flash (release-format dummy weights), 20 layers, breakable graphs.
# Usage (repo root): OUT=/dir [MODEL=dsv4-flash] [NUM_LAYERS=20] [SETTINGS="off k1a1 k3a2 k3a3"] \
#   [IN=1024] [OUTLENS="256"] [CONCS="1 16 64"] [EXTRA="--enable-breakable-cuda-graph"] \
#   bash benchmark/serving/speculative_mtp.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
MODEL=${MODEL:-dsv4-flash}; IN=${IN:-1024}; OUTLENS=${OUTLENS:-${OUTLEN:-256}}; CONCS=${CONCS:-1 16 64}
EXTRA=${EXTRA---enable-breakable-cuda-graph}
layers=""; [[ -n ${NUM_LAYERS-20} ]] && layers="--num-layers ${NUM_LAYERS-20}"
source "$(dirname "$0")/server.sh"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD/python:$PWD/sgl-kernel/python${PYTHONPATH:+:$PYTHONPATH}
port=30300
for setting in ${SETTINGS:-off k1a1 k3a2 k3a3}; do
  flags="$EXTRA"; simulate=""
  if [[ $setting =~ ^k([0-9])a([0-9.]+)(e?)$ ]]; then
    flags="$flags --speculative-algorithm mtp --speculative-num-steps ${BASH_REMATCH[1]}"; simulate=${BASH_REMATCH[2]}
    [[ -n ${BASH_REMATCH[3]} ]] && flags="--disable-cuda-graph --speculative-algorithm mtp --speculative-num-steps ${BASH_REMATCH[1]}"
  elif [[ $setting != off ]]; then
    echo "unknown setting $setting (off, or k<steps>a<accepted>[e])"; exit 2
  fi
  if SGLANG_SIMULATE_ACCEPT_LENGTH=$simulate start_server "$setting" $port "$OUT/server_$setting.log" 150 \
    --model-path $MODEL --load-format dummy $layers $flags; then
    for outlen in $OUTLENS; do
      for c in $CONCS; do
        n=$(( c == 1 ? 4 : 2 * c ))
        timeout 300 python -m sglang.bench_serving --port $port --num-prompts $n --max-concurrency $c \
          --random-input-len $IN --random-output-len $outlen --warmup-requests 2 --tag "${setting}_o${outlen}_c$c" \
          --output-file "$OUT/speculative.jsonl" > "$OUT/spec_${setting}_o${outlen}_c$c.log" 2>&1
        echo "out=$outlen c=$c rc=$?"
      done
    done
    curl -s "http://127.0.0.1:$port/get_server_info" > "$OUT/server_info_$setting.json"
  else
    tail -5 "$OUT/server_$setting.log"
  fi
  stop_server
  port=$(( port + 1 ))
done
python - "$OUT" <<'PY'
import glob, json, sys
try:
    runs = [json.loads(line) for line in open(f"{sys.argv[1]}/speculative.jsonl")]
except OSError as e:
    sys.exit(f"no results: {e}")
def key(r):
    setting, rest = r["args"]["tag"].split("_o", 1)
    return setting, rest
base = {key(r)[1]: r for r in runs if key(r)[0] == "off"}
print(f"{'setting':<12}{'out':>6}{'conc':>5}{'TPOT p50 ms':>13}{'out tok/s':>11}{'vs off':>8}")
for r in runs:
    setting, rest = key(r)
    outlen, c = rest.split("_c")
    off = base.get(rest)
    gain = r["output_throughput"] / off["output_throughput"] if off else float("nan")
    print(f"{setting:<12}{outlen:>6}{c:>5}{r['tpot_ms']['p50']:>13.2f}{r['output_throughput']:>11.1f}{gain:>8.2f}")
for path in sorted(glob.glob(f"{sys.argv[1]}/server_info_*.json")):
    st = json.load(open(path))["scheduler_stats"]
    keys = {k: v for k, v in st.items() if k.startswith(("spec_", "breakable_replays", "forward_mtp", "mtp_"))}
    print(path.rsplit("/", 1)[1], json.dumps(keys, default=str)[:600])
PY
