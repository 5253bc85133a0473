"""End to end on CPU: `python -m sglang.launch_server --model-path dsv4-tiny` in a subprocess,
driven with the official `openai` client and plain HTTP. Specifies the OpenAI and native API
shapes, streaming, concurrency, batch-invariant greedy output, the 400/404 battery, client
disconnects, and process hygiene (SIGTERM, scheduler death)."""

import ast
import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from sglang.srt.tokenizer import ByteTokenizer
from sglang.test.server_process import ServerProcess, descendant_pids, free_port, still_alive_after
from sglang.test.kv_accounting import assert_stats_no_request_holds_kv

# the test extra: without it this module skips instead of failing collection
requests = pytest.importorskip("requests", exc_type=ImportError)

REPO_ROOT = Path(__file__).resolve().parents[3]
MODEL = "dsv4-tiny"
CONTEXT_LENGTH = 4096  # the CPU default: min(max_position_embeddings, 4096)
TOK = ByteTokenizer(512)
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def _server_command(port: int, *extra_args: str):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT / "python"), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", MODEL, "--device", "cpu",
           "--port", str(port), *extra_args]
    return cmd, env


class Server(ServerProcess):
    def __init__(self, tmp_dir: Path, *extra_args: str):
        port = free_port()
        cmd, env = _server_command(port, *extra_args)
        super().__init__(cmd, port, tmp_dir / f"server-{port}.log", env)
        self.wait_ready(180, poll_s=0.25)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("server"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai", exc_type=ImportError)  # only the tests driving the official client need it
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _generate(server, input_ids, max_new_tokens, stream=False, **sampling):
    body = {"input_ids": input_ids, "stream": stream,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True, **sampling}}
    r = requests.post(server.url + "/generate", json=body, stream=stream, timeout=120)
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()
    lines = [line.decode("utf-8") for line in r.iter_lines() if line.startswith(b"data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def _stats(server) -> dict:
    return requests.get(server.url + "/get_server_info", timeout=30).json()["scheduler_stats"]


# ---- API shapes ---------------------------------------------------------------------------


def test_health_models_and_server_info(server, client):
    assert requests.get(server.url + "/health", timeout=5).json() == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    info = requests.get(server.url + "/get_server_info", timeout=30).json()
    assert (info["model_path"], info["device"], info["dtype"]) == (MODEL, "cpu", "float32")
    assert (info["context_length"], info["vocab_size"]) == (CONTEXT_LENGTH, 512)
    stats = info["scheduler_stats"]
    assert {"num_running_reqs", "num_waiting_reqs", "num_forwards", "num_free_pages"} <= set(stats)
    # the kernel path in use (CPU: plain torch everywhere)
    assert (stats["attention_kernels"], stats["segment_kernels"]) == ("torch", False)
    # the KV cache's size: the CPU default of 65536 tokens holds 16 requests of the context
    # length, at the pool's bytes per token (a bf16-format model: model-dtype KV)
    import math

    import torch

    from sglang.srt.configs.presets import get_preset
    from sglang.srt.mem_cache.dsv4_kv_pool import kv_bytes_per_token

    assert info["kv_cache_dtype"] == "auto" and info["max_running_requests"] == 64
    assert (info["kv_capacity_tokens"], info["kv_capacity_requests"]) == (65536, 65536 // CONTEXT_LENGTH)
    assert info["kv_bytes_per_token"] == math.ceil(kv_bytes_per_token(get_preset(MODEL), torch.float32))
    assert {k: stats[k] for k in ("kv_capacity_tokens", "kv_capacity_requests", "kv_bytes_per_token")} == {
        k: info[k] for k in ("kv_capacity_tokens", "kv_capacity_requests", "kv_bytes_per_token")}


def test_completion(client):
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, **GREEDY)
    assert out.object == "text_completion" and out.model == MODEL
    assert out.choices[0].finish_reason == "length"
    assert isinstance(out.choices[0].text, str)
    # 5 bytes in (raw prompts get no BOS, as the DSV4 release's add_bos_token is false),
    # exactly max_tokens out.
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (5, 8, 13)


def test_chat_completion(client):
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=5, **GREEDY
    )
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason == "length"
    # <BOS><｜User｜>Hi<｜Assistant｜></think>: 6 ids with the byte tokenizer.
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (6, 5)


def test_native_generate_with_input_ids(server):
    out = _generate(server, [10, 20, 30], 5)
    assert len(out["output_ids"]) == 5
    assert out["text"] == TOK.decode(out["output_ids"])
    meta = out["meta_info"]
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (3, 5)
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    # Streaming: SSE events with the text and ids so far; the last one equals the response.
    events = _generate(server, [10, 20, 30], 5, stream=True)
    assert len(events) >= 2
    assert events[-1]["output_ids"] == out["output_ids"] and events[-1]["text"] == out["text"]
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 5}


def test_generate_returns_the_logprobs_of_its_tokens_and_the_top_alternatives(server):
    body = {"input_ids": [10, 20, 30], "return_logprob": True, "top_logprobs_num": 3,
            "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}
    out = requests.post(server.url + "/generate", json=body, timeout=120).json()
    meta, ids = out["meta_info"], out["output_ids"]
    assert [t for _, t, _ in meta["output_token_logprobs"]] == ids
    assert len(meta["output_top_logprobs"]) == len(ids) == 5
    for (lp, tok, _), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"]):
        assert len(top) == 3 and top[0][:2] == [lp, tok]  # greedy: the chosen token is the most likely
        assert lp <= 0 and top[0][0] >= top[1][0] >= top[2][0]
    # Streaming carries them so far, like the ids; the last event equals the response.
    events = requests.post(server.url + "/generate", json=dict(body, stream=True), stream=True, timeout=120)
    last = [json.loads(line[6:]) for line in events.iter_lines() if line.startswith(b"data: {")][-1]
    assert last["meta_info"]["output_token_logprobs"] == meta["output_token_logprobs"]
    assert last["meta_info"]["output_top_logprobs"] == meta["output_top_logprobs"]
    plain = _generate(server, [10, 20, 30], 5)
    assert plain["output_ids"] == ids and "output_token_logprobs" not in plain["meta_info"]


def test_openai_logprobs_match_the_native_ones(server, client):
    """Completions' `logprobs: n` and chat's `logprobs` / `top_logprobs`, streamed and not,
    carry the same values as /generate's for the same prompt ids."""
    ids = TOK.encode("The sky is")
    native = requests.post(server.url + "/generate", timeout=120, json={
        "input_ids": ids, "return_logprob": True, "top_logprobs_num": 2,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}).json()["meta_info"]
    want = [lp for lp, _, _ in native["output_token_logprobs"]]
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, logprobs=2, **GREEDY)
    lp = out.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(want, abs=1e-6) and len(lp.tokens) == 4
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    assert all(len(top) >= 1 and max(top.values()) == pytest.approx(v, abs=1e-6) for top, v in zip(lp.top_logprobs, want))
    assert client.completions.create(model=MODEL, prompt=ids, max_tokens=4, **GREEDY).choices[0].logprobs is None

    messages = [{"role": "user", "content": "Hi!"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, logprobs=True, top_logprobs=2,
                                          **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 4
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.bytes == list(entry.token.encode())
    chunks = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, logprobs=True,
                                            top_logprobs=2, stream=True, **GREEDY)
    streamed = [e for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


def test_stop_string_ends_the_request_and_is_cut_from_the_text(server, client):
    full = _generate(server, [40, 41, 42], 32)
    # A stop string taken from the greedy output itself: its first printable ASCII character.
    stop = next(ch for ch in full["text"] if ch.isascii() and ch.isprintable())
    expected = full["text"][: full["text"].find(stop)]
    out = _generate(server, [40, 41, 42], 32, stop=[stop])
    assert out["text"] == expected
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["output_ids"] == full["output_ids"][: len(out["output_ids"])]
    assert len(out["output_ids"]) < 32
    events = _generate(server, [40, 41, 42], 32, stream=True, stop=[stop])
    assert events[-1]["text"] == expected
    assert not any(stop in e["text"] for e in events)  # never streamed, then taken back
    comp = client.completions.create(model=MODEL, prompt=[40, 41, 42], max_tokens=32, stop=stop, **GREEDY)
    assert comp.choices[0].text == expected and comp.choices[0].finish_reason == "stop"


def test_streaming_concatenates_to_the_non_streamed_greedy_text(client):
    prompt = "The quick brown fox"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, **GREEDY)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, stream=True, **GREEDY))
    assert len(chunks) >= 3
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"

    messages = [{"role": "user", "content": "Tell me a story"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, **GREEDY)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, stream=True, stream_options={"include_usage": True}, **GREEDY
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 24 and chunks[-1].choices == []


# ---- concurrency --------------------------------------------------------------------------


def test_32_concurrent_requests_finish_and_greedy_is_the_same_alone_and_under_load(server, client):
    probe = [7, 70, 170, 250, 33, 99]
    alone = _generate(server, probe, 12)["output_ids"]

    def completion(i):
        max_tokens = 4 + i % 9
        out = client.completions.create(model=MODEL, prompt=f"request {i}: " + "x" * (i * 3), max_tokens=max_tokens, **GREEDY)
        return max_tokens, out.usage.completion_tokens, out.choices[0].finish_reason

    with ThreadPoolExecutor(32) as pool:
        futures = [pool.submit(completion, i) for i in range(31)]
        under_load = pool.submit(_generate, server, probe, 12)
        results = [f.result() for f in futures]
    assert all(got == want and reason == "length" for want, got, reason in results), results
    assert under_load.result()["output_ids"] == alone


# ---- bad input ----------------------------------------------------------------------------

BAD_REQUESTS = [
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": True}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "needs logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": "yes"}, "logprobs"),
    ("/generate", {"input_ids": [1, 2], "return_logprob": "yes"}, "return_logprob"),
    ("/generate", {"input_ids": [1, 2], "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
    ("/generate", {"input_ids": [1, 2], "top_logprobs_num": 2}, "needs return_logprob"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -0.5}, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": [5] * (CONTEXT_LENGTH + 10)}, "context length"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stream": "yes"}, "stream"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 2}, "n must be 1"),
    ("/v1/completions", {"model": MODEL, "prompt": 42}, "prompt"),
    ("/v1/completions", {"model": MODEL}, "prompt is required"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 999]}, "outside the vocabulary"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": CONTEXT_LENGTH}, "context length"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"model": MODEL}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "narrator", "content": "x"}]}, "narrator"),
    ("/generate", {"text": "hi", "input_ids": [1]}, "exactly one of"),
    ("/generate", {"text": "hi", "sampling_params": {"bogus": 1}}, "bogus"),
    ("/generate", {"input_ids": "abc"}, "input_ids"),
    ("/generate", [1, 2, 3], "JSON object"),
]


def test_bad_input_battery_gets_400s_and_the_server_keeps_serving(server, client):
    import openai  # present: the client fixture has it
    # A normal request in flight during the whole battery must finish undisturbed.
    background = ThreadPoolExecutor(1).submit(_generate, server, [11, 12, 13], 48, True)
    for path, body, needle in BAD_REQUESTS:
        r = requests.post(server.url + path, json=body, timeout=30)
        assert r.status_code == 400, (path, body, r.status_code, r.text)
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and needle in error["message"], (body, error)
    r = requests.post(server.url + "/v1/completions", data=b'{"prompt": "hi",', timeout=30)
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    r = requests.post(server.url + "/v1/completions", json={"model": "gpt-4", "prompt": "hi"}, timeout=30)
    assert r.status_code == 404 and "gpt-4" in r.json()["error"]["message"]
    # The official client surfaces them as its typed errors.
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="hi", temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])

    events = background.result(timeout=120)
    assert len(events[-1]["output_ids"]) == 48
    out = client.completions.create(model=MODEL, prompt="still alive?", max_tokens=4, **GREEDY)
    assert out.usage.completion_tokens == 4
    assert _stats(server)["num_failed_reqs"] == 0


def test_client_disconnect_aborts_the_request(server):
    aborted_before = _stats(server)["num_aborted_reqs"]
    body = {"input_ids": [1, 2, 3], "stream": True, "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    with requests.post(server.url + "/generate", json=body, stream=True, timeout=60) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line).startswith(b"data: ")
    # Closing the connection cancels the handler, which aborts the request in the scheduler.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = _stats(server)
        if stats["num_aborted_reqs"] == aborted_before + 1 and stats["num_running_reqs"] == 0:
            break
        time.sleep(0.2)
    assert stats["num_aborted_reqs"] == aborted_before + 1
    assert stats["num_running_reqs"] == 0
    assert_stats_no_request_holds_kv(stats)
    # A non-streamed request whose client gives up is aborted too.
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    with pytest.raises(requests.ReadTimeout):
        requests.post(server.url + "/generate", json=body, timeout=1.0)
    deadline = time.monotonic() + 30
    while _stats(server)["num_aborted_reqs"] < aborted_before + 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    stats = _stats(server)
    assert stats["num_aborted_reqs"] == aborted_before + 2 and stats["num_running_reqs"] == 0


# ---- process hygiene ----------------------------------------------------------------------


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_stops_the_server_and_leaves_no_child(server):
    children = descendant_pids(server.proc.pid)
    scheduler_pid = requests.get(server.url + "/get_server_info", timeout=30).json()["scheduler_pid"]
    assert scheduler_pid in children
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(30) == 0
    assert still_alive_after(children) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_scheduler_death_fails_in_flight_requests_and_the_server_exits_nonzero(tmp_path):
    s = Server(tmp_path)
    try:
        scheduler_pid = requests.get(s.url + "/get_server_info", timeout=30).json()["scheduler_pid"]
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
        in_flight = ThreadPoolExecutor(1).submit(requests.post, s.url + "/generate", json=body, timeout=60)
        deadline = time.monotonic() + 30
        while _stats(s)["num_running_reqs"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(scheduler_pid, signal.SIGKILL)
        r = in_flight.result(timeout=30)
        assert r.status_code == 503
        assert "scheduler process exited" in r.json()["error"]["message"]
        assert s.proc.wait(30) == 1
    finally:
        s.stop()


@pytest.mark.parametrize("args,reason", [
    (("--context-length", "100000"), "exceeds the model's max_position_embeddings (4096)"),
    (("--device", "cuda"), "--device cuda was requested but CUDA is not available"),
], ids=["context-length", "device-cuda"])
def test_startup_failure_exits_nonzero_with_the_reason_and_no_traceback(args, reason):
    if args[0] == "--device" and torch.cuda.is_available():
        pytest.skip("a CUDA device is present: --device cuda starts")
    cmd, env = _server_command(free_port(), *args)
    cmd.remove("--device") if args[0] == "--device" else None
    if args[0] == "--device":
        cmd.remove("cpu")
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 1
    assert reason in out
    assert "Traceback" not in out, out  # an expected start-up error is a message, not a stack


# ---- the README's examples, as a new user would run them --------------------------------------


def _readme_blocks(lang: str) -> list[str]:
    text = (REPO_ROOT / "README.md").read_text()
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def test_readme_endpoint_table_is_the_servers_routes():
    from types import SimpleNamespace

    from sglang.srt.entrypoints.http_server import create_app

    text = (REPO_ROOT / "README.md").read_text()
    documented = set()
    for cell in re.findall(r"^\| (`(?:GET|POST) [^|]*)\|", text, flags=re.M):
        documented |= {(m, re.sub(r"\{[^}]*\}", "{}", path)) for m, path in re.findall(r"`(GET|POST) (/[^`]*)`", cell)}
    app = create_app(SimpleNamespace(server_args=SimpleNamespace(max_request_bytes=1 << 20)))
    served = {(r.method, re.sub(r"\{[^}]*\}", "{}", r.resource.canonical)) for r in app.router.routes()
              if r.method in ("GET", "POST")}
    assert documented == served


def test_readme_curl_and_openai_examples_work_against_the_server(tmp_path):
    pytest.importorskip("openai", exc_type=ImportError)  # the README's example uses the official client
    server = Server(tmp_path)  # its own: the module's server is stopped by the SIGTERM test above
    try:
        _run_readme_http_examples(server)
    finally:
        server.stop()


def _run_readme_http_examples(server):
    curls = re.findall(r"curl -s\w* localhost:30000(\S+) .*?-d '(.*?)'", "".join(_readme_blocks("bash")), flags=re.S)
    assert [path for path, _ in curls] == ["/generate", "/v1/chat/completions", "/v1/chat/completions"]
    for path, body in curls:
        payload = json.loads(body)
        r = requests.post(server.url + path, json=payload, stream=payload.get("stream", False), timeout=120)
        assert r.status_code == 200, r.text
        if payload.get("stream"):
            lines = [ln for ln in r.iter_lines(decode_unicode=True) if ln.startswith("data:")]
            assert lines[-1] == "data: [DONE]" and len(lines) > 2
        elif path == "/generate":
            assert r.json()["text"] and r.json()["meta_info"]["completion_tokens"] == 16
        else:  # the tool-call example: random weights rarely call, but the shape is OpenAI's
            choice = r.json()["choices"][0]
            assert choice["message"]["role"] == "assistant" and choice["finish_reason"] in ("stop", "length", "tool_calls")
    openai_blocks = [b for b in _readme_blocks("python") if "import openai" in b]
    assert len(openai_blocks) == 2  # plain chat and completions; tools with reasoning
    for block in openai_blocks:
        code = block.replace("http://127.0.0.1:30000/v1", server.url + "/v1")
        assert code != block
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(code, "README.md (openai example)", "exec"), {})
        assert printed.getvalue().strip()


def test_readme_engine_example_runs():
    engine_block = next(b for b in _readme_blocks("python") if "from sglang import Engine" in b)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(engine_block, "README.md (Engine example)", "exec"), {})
    texts, reason = printed.getvalue().strip().rsplit("] ", 1)  # print(list_of_texts, finish_reason)
    texts, reason = ast.literal_eval(texts + "]"), ast.literal_eval(reason)
    assert len(texts) == 2 and all(isinstance(t, str) and t for t in texts)
    assert reason["type"] in ("length", "stop")  # 16 new tokens, or an EOS before them
