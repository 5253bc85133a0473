"""Load and leaks on CPU: 1000 concurrent streaming requests against one real server, a seeded
fifth of them dropped by their client mid-stream. No request fails, and KV pages, request slots
and the processes' RSS return to their idle values."""

import asyncio
import os
import random
import sys
import time
from pathlib import Path

import aiohttp
import pytest
import requests

from sglang.test.server_process import ServerProcess, descendant_pids, free_port

REPO_ROOT = Path(__file__).resolve().parents[3]
NUM_REQUESTS = 1000
RSS_TOLERANCE_BYTES = 96 * 1024 * 1024  # allocator slack after 1000 requests, not a leak


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def _stats(url: str) -> dict:
    return requests.get(url + "/get_server_info", timeout=30).json()["scheduler_stats"]


async def _one(session, url: str, i: int, abort_after: int | None) -> str:
    body = {"input_ids": [3 + i % 97, 5, 7 + i % 13], "stream": True,
            "sampling_params": {"max_new_tokens": 3, "ignore_eos": True, "temperature": 0}}
    async with session.post(url + "/generate", json=body) as r:
        if r.status != 200:
            return f"status {r.status}: {await r.text()}"
        events = 0
        async for line in r.content:
            if not line.startswith(b"data: "):
                continue
            if line.startswith(b"data: [DONE]"):
                return "done"
            if b'"error"' in line:
                return f"error event: {line[:300]!r}"
            events += 1
            if abort_after is not None and events >= abort_after:
                return "aborted"  # leaving the block closes the connection mid-stream
    return "stream ended without [DONE]"


async def _run_all(url: str, seed: int) -> list:
    rng = random.Random(seed)
    plans = [rng.choice([1, 2]) if rng.random() < 0.2 else None for _ in range(NUM_REQUESTS)]
    connector = aiohttp.TCPConnector(limit=NUM_REQUESTS)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        return await asyncio.gather(*(_one(session, url, i, p) for i, p in enumerate(plans)))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_1000_concurrent_streams_with_random_aborts_leave_no_leak(tmp_path):
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT / "python"), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", "dsv4-tiny", "--device", "cpu",
           "--port", str(port), "--max-running-requests", "256"]
    server = ServerProcess(cmd, port, tmp_path / "server.log", env).wait_ready(180, 0.25)
    try:
        pids = [server.proc.pid] + descendant_pids(server.proc.pid)
        # Warm up (first forwards allocate their workspaces), then take the idle values.
        for _ in range(2):
            requests.post(server.url + "/generate", json={"input_ids": [1, 2, 3],
                                                          "sampling_params": {"max_new_tokens": 2}}, timeout=120)
        idle = _stats(server.url)
        idle_rss = {pid: _rss_bytes(pid) for pid in pids}

        start = time.monotonic()
        results = asyncio.run(_run_all(server.url, seed=15))
        elapsed = time.monotonic() - start
        failures = [r for r in results if r not in ("done", "aborted")]
        assert failures == [], failures[:5]
        assert results.count("aborted") > 100 and results.count("done") > 700
        assert elapsed < 60, f"1000 streams took {elapsed:.1f} s"

        deadline = time.monotonic() + 30  # aborts of dropped streams reach the scheduler
        while time.monotonic() < deadline:
            stats = _stats(server.url)
            if stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0:
                break
            time.sleep(0.2)
        assert (stats["num_running_reqs"], stats["num_waiting_reqs"]) == (0, 0)
        assert stats["num_free_pages"] == idle["num_free_pages"] == stats["num_total_pages"]
        assert stats["num_free_req_slots"] == idle["num_free_req_slots"]
        assert stats["num_failed_reqs"] == 0
        assert stats["num_finished_reqs"] + stats["num_aborted_reqs"] >= NUM_REQUESTS
        for pid, before in idle_rss.items():
            after = _rss_bytes(pid)
            assert after - before < RSS_TOLERANCE_BYTES, (pid, before, after)
    finally:
        server.stop()
