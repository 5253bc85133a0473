"""GET /metrics on a real server (dsv4-tiny on CPU in a subprocess), read back with
prometheus_client's own parser: request counts by finish reason, token counters and latency
histograms that match the requests sent, scheduler gauges per DP rank, an abort counted."""

import os
import sys
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sglang.test.server_process import ServerProcess, free_port

# the test extra: without it this module skips instead of failing collection
requests = pytest.importorskip("requests", exc_type=ImportError)

REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT / "python"), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", "dsv4-tiny", "--device", "cpu",
           "--port", str(port)]
    s = ServerProcess(cmd, port, tmp_path_factory.mktemp("metrics") / "server.log", env)
    s.wait_ready(180, poll_s=0.25)
    yield s
    s.stop()


def scrape(server) -> dict:
    """{(name, labels as a sorted tuple): value} of every sample, and the content type."""
    r = requests.get(server.url + "/metrics", timeout=30)
    assert r.status_code == 200
    samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            samples[s.name, tuple(sorted(s.labels.items()))] = s.value
    return samples, r.headers["Content-Type"]


def value(samples, name, **labels):
    return samples[name, tuple(sorted(labels.items()))]


def _generate(server, text, max_new_tokens, stream=False):
    return requests.post(server.url + "/generate", json={
        "text": text, "stream": stream,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}},
        timeout=120, stream=stream)


def test_metrics_count_the_requests_tokens_and_latencies(server):
    before, content_type = scrape(server)
    assert content_type.startswith("text/plain; version=")  # the text format prometheus_client writes
    # every finish reason exists at zero before any request ends with it
    for reason in ("stop", "length", "abort", "error"):
        assert ("sglang:requests_total", (("finish_reason", reason),)) in before
    prompts = ["Hello there", "The sky is", "Count: 1 2 3"]
    metas = [_generate(server, p, n).json()["meta_info"] for p, n in zip(prompts, (5, 3, 1))]
    streamed = _generate(server, "Once upon a time", 4, stream=True)
    assert streamed.status_code == 200 and b"[DONE]" in streamed.content
    assert requests.post(server.url + "/generate", json={"text": ""}, timeout=30).status_code == 400  # never started
    after, _ = scrape(server)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("sglang:requests_total", finish_reason="length") == 4
    assert delta("sglang:requests_total", finish_reason="error") == 0
    assert delta("sglang:generation_tokens_total") == 5 + 3 + 1 + 4
    prompt_tokens = sum(m["prompt_tokens"] for m in metas)
    assert delta("sglang:prompt_tokens_total") >= prompt_tokens + 1  # + the streamed prompt
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert delta(f"sglang:{hist}_count") == 4
        assert delta(f"sglang:{hist}_sum") > 0
    # TPOT needs two tokens: the 1-token request has none
    assert delta("sglang:time_per_output_token_seconds_count") == 3
    # ITL: one observation per token after a request's first chunk (at most tokens - 1 each)
    assert 1 <= delta("sglang:inter_token_latency_seconds_count") <= 4 + 2 + 0 + 3
    assert value(after, "sglang:num_requests_in_flight") == 0
    # the scheduler's gauges, per DP rank
    total = value(after, "sglang:kv_pages_total", dp_rank="0")
    # every request has finished: no request holds a page; what the prefix cache kept is apart
    assert total > 0 and value(after, "sglang:kv_pages_used", dp_rank="0") == 0
    assert 0 <= value(after, "sglang:kv_pages_cached", dp_rank="0") <= total
    assert value(after, "sglang:kv_page_size_tokens", dp_rank="0") == 128
    assert value(after, "sglang:num_running_reqs", dp_rank="0") == 0
    assert value(after, "sglang:num_queue_reqs", dp_rank="0") == 0
    assert sum(v for (name, _), v in after.items() if name == "sglang:forward_passes_total") > 0


def test_a_client_that_goes_away_is_counted_as_an_abort(server):
    before, _ = scrape(server)
    r = _generate(server, "A long story", 2000, stream=True)
    next(r.iter_lines())  # the first event: the request is running
    r.close()  # the client goes away mid-stream
    deadline = time.time() + 30
    while True:
        after, _ = scrape(server)
        aborted = value(after, "sglang:requests_total", finish_reason="abort") - \
            value(before, "sglang:requests_total", finish_reason="abort")
        if aborted == 1 or time.time() > deadline:
            break
        time.sleep(0.2)
    assert aborted == 1
    assert value(after, "sglang:num_requests_in_flight") == 0


def test_pages_the_prefix_cache_keeps_are_counted_apart_from_the_used_ones(server):
    """A finished request of three pages of prompt leaves its full pages in the prefix cache
    (on by default): kv_pages_cached counts them, kv_pages_used stays 0."""
    r = _generate(server, "The cache keeps whole pages. " * 14, 2)  # about 400 byte-level tokens
    assert r.status_code == 200, r.text
    after, _ = scrape(server)
    total = value(after, "sglang:kv_pages_total", dp_rank="0")
    assert value(after, "sglang:kv_pages_used", dp_rank="0") == 0
    assert 3 <= value(after, "sglang:kv_pages_cached", dp_rank="0") < total
