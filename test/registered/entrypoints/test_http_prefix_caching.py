"""Prefix caching through the HTTP server on CPU: `launch_server --enable-prefix-caching` with
two DP-attention ranks (each keeps its own tree; round-robin routing), cached_tokens in each
/generate response's meta_info and the OpenAI usage, hit rate and cached tokens in
/get_server_info (per rank and combined); contradicting flags stop the launch with the reason."""

import subprocess

import pytest

from sglang.srt.server_args_cli import prepare_server_args

from test_http_server import Server, _server_command  # noqa: E402  (same directory)

requests = pytest.importorskip("requests", exc_type=ImportError)
P = 128


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("prefix"), "--enable-prefix-caching", "--page-size", str(P),
               "--enable-dp-attention", "--dp-size", "2", "--load-balance-method", "round_robin",
               "--max-total-tokens", "4096", "--context-length", "1024")
    yield s
    s.stop()


def _generate(server, ids, n=6):
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    r = requests.post(server.url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_cached_tokens_per_response_and_hit_rate_per_rank(server):
    shared = [(7 * i) % 500 + 2 for i in range(2 * P + 20)]
    a = _generate(server, shared + [11] * 30)  # rank 0: caches up to 256
    b = _generate(server, [(5 * i) % 500 + 2 for i in range(200)])  # rank 1
    c0 = _generate(server, shared + [13] * 9)  # rank 0: takes a's 256 tokens
    c1 = _generate(server, shared + [13] * 9)  # rank 1: nothing of it cached there
    assert [x["meta_info"]["cached_tokens"] for x in (a, b, c0, c1)] == [0, 0, 2 * P, 0]
    assert c0["output_ids"] == c1["output_ids"]  # same greedy tokens with and without the cache
    info = requests.get(server.url + "/get_server_info", timeout=30).json()
    assert info["enable_prefix_caching"] is True and info["disable_radix_cache"] is False
    ranks = info["dp_rank_stats"]
    assert [r["prefix_cache_hit_tokens"] for r in ranks] == [2 * P, 0]
    assert [r["prefix_cache_lookup_tokens"] for r in ranks] == [len(shared) + 30 + len(shared) + 9, 200 + len(shared) + 9]
    assert all(r["prefix_cache_cached_tokens"] >= P for r in ranks)
    total = info["scheduler_stats"]
    looked = sum(r["prefix_cache_lookup_tokens"] for r in ranks)
    assert total["prefix_cache_hit_rate"] == pytest.approx(2 * P / looked)
    assert total["prefix_cache_cached_tokens"] == sum(r["prefix_cache_cached_tokens"] for r in ranks)


def test_openai_usage_reports_cached_prompt_tokens(server):
    shared = [(3 * i) % 500 + 2 for i in range(P + 10)]
    body = {"model": "dsv4-tiny", "prompt": shared, "max_tokens": 2, "temperature": 0}
    seen = []
    for _ in range(4):  # twice on each rank: the second on each hits
        r = requests.post(server.url + "/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        seen.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert sorted(seen) == [0, 0, P, P]


def test_contradicting_flags_are_refused_with_the_reason(tmp_path):
    with pytest.raises(ValueError, match="--enable-prefix-caching and --disable-radix-cache contradict"):
        prepare_server_args(["--enable-prefix-caching", "--disable-radix-cache"])
    cmd, env = _server_command(0, "--enable-prefix-caching", "--disable-radix-cache")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "--disable-radix-cache turns prefix caching off" in done.stderr + done.stdout
