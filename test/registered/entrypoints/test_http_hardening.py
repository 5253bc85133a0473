"""No client input gets a 5xx, and the server never blocks: against one real CPU server
(dsv4-tiny, a 1024-token KV pool), a seeded fuzz of 1200 malformed requests, the inputs that
used to be 500s, the request-size limit (413 from Content-Length and while streaming), /health
while a maximal body is parsed, refusal up front of what can never fit, and the API polish
(GET /v1/models/{id}, tools refused, empty prompts)."""

import collections
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sglang.test.server_process import ServerProcess, free_port

# the test extra: without it this module skips instead of failing collection
requests = pytest.importorskip("requests", exc_type=ImportError)

REPO_ROOT = Path(__file__).resolve().parents[3]
MODEL = "dsv4-tiny"
KV_TOKENS = 1024
MAX_REQUEST_BYTES = 32 * 1024 * 1024  # the default
PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")


def _server_command(port: int, *extra_args: str):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT / "python"), os.environ.get("PYTHONPATH", "")]))
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", MODEL, "--device", "cpu",
            "--port", str(port), *extra_args], env


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    cmd, env = _server_command(port, "--max-total-tokens", str(KV_TOKENS))
    s = ServerProcess(cmd, port, tmp_path_factory.mktemp("hardening") / "server.log", env).wait_ready(180, 0.25)
    yield s
    s.stop()


def _post_raw(server, path, data: bytes, timeout=60):
    return requests.post(server.url + path, data=data, headers={"Content-Type": "application/json"}, timeout=timeout)


def _error(r) -> str:
    return r.json()["error"]["message"]


# ---- the inputs that used to be 500s --------------------------------------------------------


@pytest.mark.parametrize("data, needle", [
    (b'{"text": "\\ud800"}', "lone surrogate"),
    (b'{"text": "a\xed\xa0\x80b"}', "not valid UTF-8"),
    (b'{"text": "\xff\xfe"}', "not valid UTF-8"),
    (b"[" * 100_000 + b"]" * 100_000, "nested deeper"),
    (b'{"a":' * 5000 + b"1" + b"}" * 5000, "nested deeper"),
    (b'{"input_ids": [' + b"7" * 5001 + b"]}", "5001 digits"),
    (b'{"input_ids": [1], "sampling_params": {"temperature": 1e999}}', "out of range"),
    (b'{"input_ids": [NaN]}', "NaN is not valid JSON"),
    ('{"text": "hi"}'.encode("utf-16"), "not valid UTF-8"),
])
def test_encoding_depth_and_number_errors_are_400s_that_name_the_problem(server, data, needle):
    for path in PATHS:
        r = _post_raw(server, path, data)
        assert r.status_code == 400, (path, r.status_code, r.text[:300])
        assert needle in _error(r), (path, _error(r))


# ---- fuzz -------------------------------------------------------------------------------------

_ODD_VALUES = [None, True, False, 0, -1, 1.5, -1e300, 2**63, 10**19, "", "x", "\u00e9\u4e2d", "\x00", [], [1], [[1]],
               {}, {"a": 1}, [None], ["a"], [1.0], [-5], [10**6], "1" * 2000, list(range(3000))]
_SAMPLING_KEYS = ["temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
                  "max_new_tokens", "skip_special_tokens", "n", "bogus"]
_OPENAI_KEYS = ["prompt", "messages", "model", "max_tokens", "max_completion_tokens", "temperature", "stream",
                "stream_options", "stop", "n", "logprobs", "top_logprobs", "echo", "logit_bias", "tools", "tool_choice", "seed",
                "response_format", "chat_template_kwargs", "top_p", "suffix"]


def _valid_body(path: str) -> dict:
    # At most one generated token, so a case that turns out valid costs one short forward.
    if path == "/generate":
        return {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1}}
    if path == "/v1/completions":
        return {"prompt": "fuzz", "max_tokens": 1}
    # Both limits: a splice that renames one key still leaves one token.
    return {"messages": [{"role": "user", "content": "fuzz"}], "max_tokens": 1, "max_completion_tokens": 1}


def _odd(rng: random.Random):
    v = rng.choice(_ODD_VALUES)
    return v if rng.random() < 0.8 else [v, rng.choice(_ODD_VALUES)]


def _mutate_structure(rng, path) -> bytes:
    """A valid body with one to three fields set to values of odd types or ranges."""
    body = _valid_body(path)
    for _ in range(rng.randint(1, 3)):
        key = rng.choice(_SAMPLING_KEYS if path == "/generate" else _OPENAI_KEYS)
        value = _odd(rng)
        if key in ("max_new_tokens", "max_tokens", "max_completion_tokens") and (
                value is None or (isinstance(value, int) and not isinstance(value, bool) and 1 < value < 10**9)):
            value = -3  # a valid large limit would only make the case slow, not interesting
        if path == "/generate":
            if rng.random() < 0.3:
                body[rng.choice(["input_ids", "text", "rid", "stream", "extra"])] = value
            else:
                body["sampling_params"][key] = value
        elif key == "messages" and rng.random() < 0.5:
            body["messages"] = [{"role": _odd(rng), "content": _odd(rng)}]
        else:
            body[key] = value
    return json.dumps(body).encode()


def _mutate_bytes(rng, path) -> bytes:
    raw = json.dumps(_valid_body(path)).encode()
    kind = rng.randrange(6)
    if kind == 0:  # truncated
        return raw[: rng.randrange(len(raw))]
    if kind == 1:  # random bytes spliced in
        at = rng.randrange(len(raw))
        return raw[:at] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 8))) + raw[at:]
    if kind == 2:  # an escaped surrogate or control character inside a string
        esc = rng.choice([b"\\ud800", b"\\udfff", b"\\ud83d", b"\\u0000", b"\\x41", b"\\"])
        return raw.replace(b"fuzz", b"fu" + esc + b"zz") if b"fuzz" in raw else raw[:-1] + b',"t":"' + esc + b'"}'
    if kind == 3:  # nesting
        depth = rng.choice([33, 500, 999, 1001, 20_000])
        return b'{"input_ids":' + b"[" * depth + b"]" * depth + b"}"
    if kind == 4:  # a long integer or number
        return raw[:-1] + b',"seed":' + rng.choice([b"9" * rng.randint(19, 5000), b"1e400", b"-0", b"1" + b"0" * 30]) + b"}"
    return rng.choice([b"", b"null", b"[]", b"\"s\"", b"1", b"{}", b"{\"input_ids\": []}", b"\xef\xbb\xbf{}"])


def _fuzz_cases(n: int, seed: int = 1234) -> list:
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        path = PATHS[i % 3]
        cases.append((path, _mutate_structure(rng, path) if rng.random() < 0.6 else _mutate_bytes(rng, path)))
    return cases


def test_fuzz_1200_malformed_requests_never_get_a_5xx_and_the_server_stays_healthy(server):
    cases = _fuzz_cases(1200)
    assert len({data for _, data in cases}) > 900  # generated, not one case repeated
    local = threading.local()

    def send(case):
        if not hasattr(local, "session"):
            local.session = requests.Session()
        path, data = case
        r = local.session.post(server.url + path, data=data, headers={"Content-Type": "application/json"}, timeout=120)
        message = r.json()["error"]["message"] if r.status_code >= 400 else None
        return path, data, r.status_code, message, r.text[:300]

    health, done = [], threading.Event()

    def watch():  # the server stays healthy while the cases run
        with requests.Session() as session:
            while not done.is_set():
                health.append(session.get(server.url + "/health", timeout=10).status_code)
                time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    start = time.monotonic()
    watcher.start()
    try:
        # Concurrent clients, so the cases that turn out valid share forwards (one token each).
        with ThreadPoolExecutor(32) as pool:
            results = list(pool.map(send, cases))
    finally:
        done.set()
        watcher.join()
    elapsed = time.monotonic() - start
    for path, data, status, message, text in results:
        assert status < 500, (path, data[:300], status, text)
        assert status < 400 or message, (path, data[:200], text)
    statuses = collections.Counter(status for _, _, status, _, _ in results)
    assert statuses[400] > 600, statuses  # most cases are refused, the rest served
    assert health and set(health) == {200}, collections.Counter(health)
    # ~40 s alone on a 2-core machine under other load; the bound only catches a hang, since a
    # wall-clock limit tight enough to be a speed spec fails whenever CI is contended.
    print(f"fuzz: {len(cases)} cases in {elapsed:.1f} s, statuses {dict(statuses)}")
    assert elapsed < 240, f"the fuzz took {elapsed:.1f} s"
    stats = requests.get(server.url + "/get_server_info", timeout=30).json()["scheduler_stats"]
    assert stats["num_running_reqs"] == 0 and stats["num_free_pages"] == stats["num_total_pages"]


# ---- size limit and a server that keeps answering -------------------------------------------


def _raw_http(server, head: bytes, body_chunks=(), read_timeout=30) -> tuple[int, int]:
    """Send a hand-written request; returns (status, body bytes sent before the server answered)."""
    sent = 0
    with socket.create_connection(("127.0.0.1", server.port), timeout=read_timeout) as s:
        s.sendall(head)
        try:
            for chunk in body_chunks:
                s.sendall(chunk)
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed while we were still sending
        data = b""
        while b"\r\n" not in data:
            part = s.recv(4096)
            if not part:
                break
            data += part
    return int(data.split(b" ", 2)[1]), sent


def test_a_body_over_the_limit_is_refused_with_413_from_its_content_length(server):
    head = (b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 250000000\r\n\r\n")
    t0 = time.monotonic()
    status, _ = _raw_http(server, head)
    assert status == 413 and time.monotonic() - t0 < 5
    r = _post_raw(server, "/generate", b'{"text": "' + b"a" * (MAX_REQUEST_BYTES + 10) + b'"}')
    assert r.status_code == 413 and "--max-request-bytes" in _error(r)


def test_a_chunked_body_over_the_limit_is_refused_while_it_streams(server):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    mb = b"a" * (1 << 20)
    chunk = b"%x\r\n" % len(mb) + mb + b"\r\n"

    def chunks():  # 40 MiB of a body that never ends: only a refusal while it streams answers
        yield b'10\r\n{"prompt": "aaaa\r\n'
        for _ in range(40):
            yield chunk

    status, sent = _raw_http(server, head, chunks())
    assert status == 413


_SEND_FILE = """
import sys, urllib.error, urllib.request
req = urllib.request.Request(sys.argv[1], data=open(sys.argv[2], "rb").read(),
                             headers={"Content-Type": "application/json"})
try:
    print(urllib.request.urlopen(req, timeout=120).status)
except urllib.error.HTTPError as e:
    print(e.code, e.read().decode())
"""


def test_health_answers_within_100ms_while_a_maximal_body_is_parsed(server, tmp_path):
    ids, n = [], 0
    while n < MAX_REQUEST_BYTES - 64:  # the largest input_ids body under the limit
        ids.append(str(100 + len(ids) % 400))
        n += len(ids[-1]) + 1
    data = b'{"input_ids": [' + ",".join(ids).encode() + b"]}"
    assert MAX_REQUEST_BYTES - 100 < len(data) <= MAX_REQUEST_BYTES
    (tmp_path / "body.json").write_bytes(data)
    del ids, data
    session = requests.Session()
    session.get(server.url + "/health", timeout=5)
    # The body goes from another process, so this one's polling shares no interpreter with it.
    sender = subprocess.Popen([sys.executable, "-c", _SEND_FILE, server.url + "/generate", str(tmp_path / "body.json")],
                              stdout=subprocess.PIPE, text=True)
    latencies = []
    while sender.poll() is None:
        t0 = time.monotonic()
        assert session.get(server.url + "/health", timeout=5).status_code == 200
        latencies.append(time.monotonic() - t0)
        time.sleep(0.01)
    out = sender.stdout.read()
    assert out.startswith("400") and "context length" in out, out[:300]
    assert len(latencies) >= 20, latencies  # /health was polled while the body was in flight
    # Before the fix one such body stalled /health for seconds. The 95th percentile is the
    # bound: on a shared 2-core CI machine the OS itself can deschedule the server for longer
    # than 100 ms now and then, which no server design prevents.
    latencies.sort()
    assert latencies[int(0.95 * len(latencies))] < 0.1, latencies[-10:]
    assert latencies[-1] < 0.5, latencies[-10:]


# ---- refusal up front -------------------------------------------------------------------------


def test_what_can_never_fit_the_kv_pool_is_refused_before_any_work(server):
    t0 = time.monotonic()
    body = {"input_ids": [i % 500 + 1 for i in range(1000)], "sampling_params": {"max_new_tokens": 100}}
    r = requests.post(server.url + "/generate", json=body, timeout=60)
    assert r.status_code == 400 and "KV cache" in _error(r) and "1000 tokens" in _error(r)
    assert time.monotonic() - t0 < 2
    r = requests.post(server.url + "/v1/completions", json={"prompt": [1] * 1000, "max_tokens": 25}, timeout=60)
    assert r.status_code == 400 and "KV cache" in _error(r)
    assert "max_new_tokens (25)" in _error(r)
    # Without an explicit limit the request fills what remains, and finishes by length.
    body = {"input_ids": [i % 500 + 1 for i in range(1000)], "sampling_params": {"ignore_eos": True}}
    out = requests.post(server.url + "/generate", json=body, timeout=120).json()
    assert out["meta_info"]["completion_tokens"] == KV_TOKENS - 1000
    assert out["meta_info"]["finish_reason"]["type"] == "length"


# ---- API polish -------------------------------------------------------------------------------


def test_get_model_by_id(server):
    r = requests.get(server.url + f"/v1/models/{MODEL}", timeout=10)
    assert r.status_code == 200
    assert (r.json()["id"], r.json()["object"], r.json()["max_model_len"]) == (MODEL, "model", 4096)
    r = requests.get(server.url + "/v1/models/gpt-4", timeout=10)
    assert r.status_code == 404 and "gpt-4" in _error(r)


@pytest.mark.parametrize("extra", [
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
    {"tool_choice": "auto"},
    {"functions": [{"name": "f"}]},
])
def test_tools_are_refused_until_tool_calling_exists(server, extra):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **extra}
    r = requests.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and "not supported" in _error(r) and next(iter(extra)) in _error(r)


@pytest.mark.parametrize("path, body, needle", [
    ("/generate", {"text": ""}, "text is empty"),
    ("/v1/completions", {"prompt": ""}, "prompt is empty"),
    ("/v1/completions", {"prompt": []}, "prompt is empty"),
    ("/v1/completions", {"prompt": [""]}, "prompt is empty"),
])
def test_an_empty_prompt_gets_a_message_about_the_prompt(server, path, body, needle):
    r = requests.post(server.url + path, json=body, timeout=30)
    assert r.status_code == 400 and needle in _error(r), r.text
