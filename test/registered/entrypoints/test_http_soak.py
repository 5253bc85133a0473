"""The soak benchmark (`python -m sglang.bench_soak`) at CI size: a CPU server under minutes of
mixed abusive traffic (streams, disconnects, duplicate rids, stop strings, oversized and
malformed prompts) answers nothing >= 500 and nothing unexpected, and once idle holds no KV
page, request slot or request, with its threads, open files and RSS where they were after
warm-up."""

import os
import sys
from pathlib import Path

import pytest

from sglang.test.server_process import ServerProcess, free_port

pytest.importorskip("requests", exc_type=ImportError)  # the test extra; bench_soak's client
from sglang.bench_soak import ALLOWED, soak, unexpected  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[3]
DURATION_S = float(os.environ.get("SGLANG_TEST_SOAK_S", "90"))

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"), pytest.mark.timeout(900)]


def test_outcome_rules():
    assert not unexpected("generate:200") and unexpected("generate:500") and unexpected("oversized:200")
    assert not unexpected("abort:200/dup 400") and unexpected("malformed:client error ConnectionError")


def test_a_soaked_server_returns_to_where_it_started(tmp_path):
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT / "python"), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", "dsv4-tiny", "--device", "cpu", "--port", str(port),
           "--context-length", "512", "--max-running-requests", "8", "--max-total-tokens", "4096"]
    server = ServerProcess(cmd, port, tmp_path / "server.log", env).wait_ready(180, poll_s=0.25)
    try:
        report = soak(server.url, server.proc.pid, duration_s=DURATION_S, concurrency=4, sample_every_s=5,
                      warmup_s=DURATION_S / 3, max_new_tokens=24, seed=7)
    finally:
        server.stop()
    print({k: v for k, v in report.items() if k != "samples"})
    assert report["server_errors"] == 0 and report["unexpected"] == {}
    kinds = {outcome.split(":", 1)[0] for outcome in report["outcomes"]}
    assert kinds == set(ALLOWED), "every kind of traffic ran"
    assert report["requests"] >= 3 * len(ALLOWED)
    start, end = report["after_warmup"], report["idle_at_end"]
    assert (end["kv_pages_used"], end["req_slots_used"], end["running"], end["waiting"]) == (0, 0, 0, 0)
    assert end["threads"] <= start["threads"] + 2
    assert end["open_fds"] <= start["open_fds"] + 4
    assert end["rss_mib"] <= start["rss_mib"] * 1.2 + 64
    assert server.proc.returncode == 0
