"""sglang.bench_serving against a real (tiny, CPU) server: every request completes, the
percentiles are ordered, and --output-file / --tag record the run; the multi-turn workload
against a server with prefix caching (per-turn rows, conversation lengths, cached tokens of
later turns, the ideal cache's shareable tokens) and its argument checks."""

import json
import subprocess
import sys

import pytest

from sglang.bench_serving import RequestResult, Turn, shareable_tokens
from sglang.test.server_process import ServerProcess, free_port


def test_bench_serving_records_a_tagged_run_of_completed_requests(tmp_path, tiny_server):
    out = tmp_path / "serving.jsonl"
    for tag in ("first", "second"):
        run = subprocess.run([sys.executable, "-m", "sglang.bench_serving", "--port", str(tiny_server.port),
                              "--num-prompts", "4", "--max-concurrency", "2", "--random-input-len", "8",
                              "--random-output-len", "5", "--tag", tag, "--output-file", str(out)],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stdout + run.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["args"]["tag"] for line in lines] == ["first", "second"]
    for m in lines:
        assert (m["completed"], m["failed"], m["total_output_tokens"]) == (4, 0, 20)
        assert m["args"]["max_concurrency"] == 2 and m["request_throughput"] > 0
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms"):
            s = m[key]
            assert 0 < s["p50"] <= s["p90"] <= s["p99"], (key, s)
        assert m["e2e_latency_ms"]["p50"] >= m["ttft_ms"]["p50"]


# ---- multi-turn ----------------------------------------------------------------------------

S, U, O, SESSIONS, TURNS = 128, 128, 8, 2, 3  # page-sized system prompt and user messages


@pytest.fixture(scope="module")
def caching_server(tmp_path_factory):
    port = free_port()
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", "dsv4-tiny", "--device", "cpu",
           "--port", str(port), "--enable-prefix-caching", "--page-size", "128", "--context-length", "1024"]
    server = ServerProcess(cmd, port, tmp_path_factory.mktemp("caching_server") / "server.log")
    server.wait_ready(180, poll_s=0.25)
    yield server
    server.stop()


def test_multi_turn_reports_each_turn_and_later_turns_hit_the_cache(tmp_path, caching_server):
    out = tmp_path / "multi_turn.jsonl"
    run = subprocess.run([sys.executable, "-m", "sglang.bench_serving", "--port", str(caching_server.port),
                          "--dataset-name", "multi-turn", "--num-sessions", str(SESSIONS), "--num-turns", str(TURNS),
                          "--system-prompt-len", str(S), "--turn-input-len", str(U), "--turn-output-len", str(O),
                          "--max-concurrency", "2", "--random-input-len", "16", "--tag", "on",
                          "--output-file", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    m = json.loads(out.read_text())
    assert (m["dataset"], m["args"]["tag"], m["completed"], m["failed"]) == ("multi-turn", "on", SESSIONS * TURNS, 0)
    assert m["total_output_tokens"] == SESSIONS * TURNS * O
    rows = m["turns"]
    assert [r["turn"] for r in rows] == list(range(TURNS)) and all(r["completed"] == SESSIONS for r in rows)
    for i, r in enumerate(rows):
        assert r["mean_prompt_tokens"] == S + i * (U + O) + U  # the whole conversation, then the new message
        assert r["prompt_tokens"] == SESSIONS * r["mean_prompt_tokens"]
        assert 0 < r["ttft_ms"]["p50"] <= r["ttft_ms"]["p99"] and r["input_throughput"] > 0
        assert r["cached_tokens"] <= r["shareable_tokens"]  # a server never holds more than an ideal cache
        if i:
            # an ideal cache holds the session's previous prompt and all but the answer's last token
            assert r["shareable_tokens"] == SESSIONS * (S + i * (U + O) - 1)
            # and the server holds all of it: whole pages, then the tail the answer left
            assert r["cached_tokens"] == r["shareable_tokens"]
            assert r["hit_rate"] == pytest.approx(r["cached_tokens"] / r["shareable_tokens"])
    assert rows[0]["shareable_tokens"] <= (SESSIONS - 1) * S  # only the shared system prompt
    assert m["total_cached_tokens"] == sum(r["cached_tokens"] for r in rows)
    for header in ("Per turn", "hit rate", "cached/prompt"):
        assert header in run.stdout


def test_multi_turn_refuses_a_conversation_longer_than_the_context(caching_server):
    run = subprocess.run([sys.executable, "-m", "sglang.bench_serving", "--port", str(caching_server.port),
                          "--dataset-name", "multi-turn", "--num-turns", "4", "--turn-input-len", "1024"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0
    assert "the last turn needs 5632 tokens, above the server's context length 1024" in run.stderr
    run = subprocess.run([sys.executable, "-m", "sglang.bench_serving", "--dataset-name", "multi-turn",
                          "--num-turns", "0"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--num-turns must be positive, got 0" in run.stderr


def _turn(session, index, prompt, output_ids, sent_at, latency):
    result = RequestResult(prompt_len=len(prompt), success=True, output_len=len(output_ids), ttft=latency / 2,
                           latency=latency, output_ids=output_ids)
    return Turn(session, index, prompt, result, sent_at)


def test_shareable_tokens_is_what_was_sent_or_computed_before_the_turn_was_sent():
    system = [5, 6, 7, 8]
    a0 = _turn(0, 0, system + [10, 11], [20, 21, 22], sent_at=0.0, latency=2.0)  # done at 2.0
    b0 = _turn(1, 0, system + [30], [40, 41], sent_at=0.5, latency=1.0)  # a0's prompt was sent: system shared
    a1 = _turn(0, 1, system + [10, 11, 20, 21, 22, 12], [23], sent_at=2.5, latency=1.0)  # a0 finished
    b1 = _turn(1, 1, system + [30, 40, 41, 31], [42], sent_at=1.2, latency=1.0)  # b0 not finished yet at 1.2
    early = _turn(2, 0, system[:2] + [99], [1], sent_at=0.0, latency=1.0)  # nothing before it (ties do not count)
    shareable_tokens([a0, b0, a1, b1, early])
    assert [t.shareable for t in (a0, b0, a1, b1, early)] == [0, 4, 8, 5, 0]
    # b1 at 1.2: b0's prompt (5 tokens) was sent; its answer was not computed until 1.5
    whole = _turn(3, 0, list(system), [1], sent_at=3.0, latency=1.0)
    shareable_tokens([a0, whole])
    assert whole.shareable == 3  # never the whole prompt
