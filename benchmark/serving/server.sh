# Sourced by the serving benchmarks: one server at a time, started, waited for and stopped the
# same way in each.
#
# start_server LABEL PORT LOG TRIES ARGS...: `python -m sglang.launch_server ARGS --port PORT` in
#   the background (its pid in SERVER_PID, its output in LOG), /health polled every 2 s up to
#   TRIES times or until the process dies; prints "== LABEL: server up|NOT up after N s" and
#   returns 0 when it answered. Environment assignments before the call reach the server.
# stop_server: SIGTERM (the server drains) and wait.

start_server() {
  local label=$1 port=$2 log=$3 tries=$4
  shift 4
  local start up=1
  start=$(date +%s)
  python -m sglang.launch_server "$@" --port "$port" > "$log" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 1 "$tries"); do
    curl -sf "http://127.0.0.1:$port/health" > /dev/null && up=0 && break
    kill -0 "$SERVER_PID" 2> /dev/null || break
    sleep 2
  done
  echo "== $label: server $( ((up == 0)) && echo up || echo NOT up) after $(( $(date +%s) - start )) s"
  return $up
}

stop_server() {
  kill -TERM "$SERVER_PID" 2> /dev/null
  wait "$SERVER_PID" 2> /dev/null
}
