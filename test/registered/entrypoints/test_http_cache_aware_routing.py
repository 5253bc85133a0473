"""Cache-aware DP routing through the HTTP server on CPU: `launch_server --enable-prefix-caching`
with two DP-attention ranks over gloo and the default load-balance method (auto, which is then
cache_aware). A repeated prefix goes to the rank that holds it (every repeat reports the cached
tokens, one rank's stats hold every hit), unrelated prompts spread over both ranks, ranks idle
between requests wake, and a killed rank still takes the server down within seconds."""

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from test_http_server import Server  # noqa: E402  (same directory)

requests = pytest.importorskip("requests", exc_type=ImportError)
P = 128


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("cache_aware"), "--enable-prefix-caching", "--page-size", str(P),
               "--enable-dp-attention", "--dp-size", "2", "--max-total-tokens", "8192", "--context-length", "1024")
    yield s
    s.stop()


def _generate(server, ids, n=4):
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    r = requests.post(server.url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _info(server):
    return requests.get(server.url + "/get_server_info", timeout=30).json()


def _ids(seed, n):
    return [(seed * 31 + 7 * i) % 500 + 3 for i in range(n)]


def test_the_default_with_prefix_caching_under_dp_is_cache_aware(server):
    assert _info(server)["load_balance_method"] == "cache_aware"


def test_a_repeated_prefix_goes_to_the_rank_that_holds_it(server):
    before = _info(server)
    shared = _ids(1, 2 * P + 20)
    first = _generate(server, shared + _ids(2, 30))
    assert first["meta_info"]["cached_tokens"] == 0
    # between repeats, 1, 0, 1 and 2 unrelated prompts: rotation alone would move the repeats
    cached = []
    for k, unrelated in enumerate((1, 0, 1, 2)):
        for j in range(unrelated):
            _generate(server, _ids(100 + 10 * k + j, 150))
        cached.append(_generate(server, shared + _ids(10 + k, 9 + k))["meta_info"]["cached_tokens"])
    assert cached == [2 * P] * 4  # every repeat found the two shared pages: always the same rank
    after = _info(server)
    hits = [a["prefix_cache_hit_tokens"] - b["prefix_cache_hit_tokens"]
            for a, b in zip(after["dp_rank_stats"], before["dp_rank_stats"])]
    assert sorted(hits) == [0, 4 * 2 * P]  # one rank holds the prefix and served every repeat
    assert after["dp_cache_routed_reqs"] - before["dp_cache_routed_reqs"] == 4
    # the unrelated prompts did not all pile onto one rank
    done = [a["num_finished_reqs"] - b["num_finished_reqs"] for a, b in zip(after["dp_rank_stats"], before["dp_rank_stats"])]
    assert sum(done) == 9 and min(done) >= 2


def test_unrelated_prompts_in_flight_together_spread_by_load(server):
    before = _info(server)
    prompts = [_ids(200 + k, 140) for k in range(6)]
    with ThreadPoolExecutor(6) as pool:
        outs = list(pool.map(lambda ids: _generate(server, ids, n=48), prompts))
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [0] * 6
    after = _info(server)
    done = [a["num_finished_reqs"] - b["num_finished_reqs"] for a, b in zip(after["dp_rank_stats"], before["dp_rank_stats"])]
    assert done == [3, 3]  # least loaded with nothing held: outstanding requests stay even
    assert after["dp_cache_routed_reqs"] == before["dp_cache_routed_reqs"]


def test_a_killed_rank_still_fails_the_requests_and_stops_the_server(server):
    info = _info(server)
    body = {"input_ids": _ids(7, 20), "sampling_params": {"max_new_tokens": 600, "ignore_eos": True}}
    pool = ThreadPoolExecutor(2)
    futures = [pool.submit(requests.post, server.url + "/generate", json=body, timeout=60) for _ in range(2)]
    deadline = time.monotonic() + 60
    while sum(r["num_running_reqs"] for r in _info(server)["dp_rank_stats"]) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    killed_at = time.monotonic()
    os.kill(info["scheduler_pids"][1], signal.SIGKILL)
    answers = [f.result(timeout=60) for f in futures]
    assert [r.status_code for r in answers] == [503, 503]  # neither reports success
    assert any("DP rank 1 exited unexpectedly (exit code -9)" in r.json()["error"]["message"] for r in answers)
    assert time.monotonic() - killed_at < 15
    assert server.proc.wait(30) == 1
