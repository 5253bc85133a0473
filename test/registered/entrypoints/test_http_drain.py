"""Graceful drain on SIGTERM, against a real CPU server: new requests get 503 with Retry-After,
in-flight requests that finish within --shutdown-timeout finish normally, streams still open then
end with an error event and [DONE] (no dropped connection, no broken payload), and the server
exits 0 leaving no child process."""

import json
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sglang.test.server_process import ServerProcess, descendant_pids, free_port, still_alive_after

# the test extra: without it this module skips instead of failing collection
requests = pytest.importorskip("requests", exc_type=ImportError)

REPO_ROOT = Path(__file__).resolve().parents[3]
SHUTDOWN_TIMEOUT_S = 8


def _stream(url: str, max_new_tokens: int, started: threading.Barrier) -> list:
    """Every SSE payload of one streamed request, parsed ([DONE] kept as the string)."""
    body = {"input_ids": [5, 6, 7], "stream": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True, "temperature": 0}}
    events = []
    with requests.post(url + "/generate", json=body, stream=True, timeout=120) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith(b"data: "), line
            payload = line[6:].decode()
            events.append(payload if payload == "[DONE]" else json.loads(payload))
            if len(events) == 1:
                started.wait(60)
    return events


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_drains_in_flight_streams_then_exits_cleanly(tmp_path):
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT / "python"), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", "dsv4-tiny", "--device", "cpu",
           "--port", str(port), "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
    server = ServerProcess(cmd, port, tmp_path / "server.log", env).wait_ready(180, 0.25)
    try:
        children = descendant_pids(server.proc.pid)
        num_short, num_long = 6, 6
        started = threading.Barrier(num_short + num_long + 1)
        with ThreadPoolExecutor(num_short + num_long) as pool:
            # Short ones finish inside the drain window; long ones (3000 tokens) cannot.
            short = [pool.submit(_stream, server.url, 3, started) for _ in range(num_short)]
            long = [pool.submit(_stream, server.url, 3000, started) for _ in range(num_long)]
            started.wait(120)  # every stream has its first event: all are in flight
            t_term = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            r = requests.post(server.url + "/generate", json={"input_ids": [1, 2]}, timeout=30)
            assert r.status_code == 503 and r.headers.get("Retry-After"), (r.status_code, r.headers)
            assert "shutting down" in r.json()["error"]["message"]
            assert requests.get(server.url + "/health", timeout=5).status_code == 503
            short_events = [f.result(120) for f in short]
            long_events = [f.result(120) for f in long]
        for events in short_events:
            assert events[-1] == "[DONE]"
            assert events[-2]["meta_info"]["finish_reason"]["type"] == "length"
            assert len(events[-2]["output_ids"]) == 3
        for events in long_events:
            assert events[-1] == "[DONE]"
            error = events[-2]["error"]
            assert error["code"] == 503 and "--shutdown-timeout" in error["message"], error
            assert all("error" not in e for e in events[:-2])  # tokens streamed normally until then
        assert server.proc.wait(60) == 0
        elapsed = time.monotonic() - t_term
        assert SHUTDOWN_TIMEOUT_S - 1 < elapsed < SHUTDOWN_TIMEOUT_S + 20, elapsed
        assert still_alive_after(children) == []
    finally:
        server.stop()
