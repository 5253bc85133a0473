"""DP attention served end to end on CPU (gloo): `launch_server --enable-dp-attention
--dp-size 2` with breakable graphs and mixed chunks against a dp-size-1 server, two "nodes"
on loopback, the offline Engine with dp_size=2, start-up errors, and process hygiene
(SIGTERM leaves nothing behind; a killed rank takes the whole server down)."""

import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sglang.test.server_process import ServerProcess, descendant_pids, free_port, pid_alive, still_alive_after

# the test extra: without it this module skips instead of failing collection
requests = pytest.importorskip("requests", exc_type=ImportError)

REPO_ROOT = Path(__file__).resolve().parents[3]
MAX_NEW = 8
# Buckets within 3x of each other from 3 tokens up: DP applies the padding-waste rule
# (graph_dispatch), so these short prompts' steps still replay.
GRAPHS = ["--enable-breakable-cuda-graph", "--enable-mixed-chunk", "--breakable-cuda-graph-tokens", "8", "24", "64", "128"]
SMALL = ["--model-path", "dsv4-tiny", "--device", "cpu", "--context-length", "512", "--max-total-tokens", "8192",
         "--max-running-requests", "16", "--watchdog-timeout", "60"]
DP2 = ["--enable-dp-attention", "--dp-size", "2"]
# 16 prompts of 3..18 tokens (input ids: the results do not depend on a tokenizer)
PROMPTS = [[(7 * i + 13 * j) % 500 + 3 for j in range(3 + i)] for i in range(16)]

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"), pytest.mark.timeout(180)]


def _free_port_pair() -> int:
    """A port p with p + 1 free as well (rendezvous and node 0's controller)."""
    for _ in range(50):
        p = free_port()
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no two adjacent free ports")


def _env() -> dict:
    # Several model processes (servers, ranks, "nodes") share this machine's few cores: one
    # thread each, or their spinning OpenMP threads starve each other's collectives.
    return dict(os.environ, OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join([str(REPO_ROOT / "python"), os.environ.get("PYTHONPATH", "")]))


class Server(ServerProcess):
    """One `launch_server` process; `wait_ready` only for node 0 (the one with HTTP)."""

    def __init__(self, tmp_dir: Path, *args: str):
        port = free_port()
        cmd = [sys.executable, "-m", "sglang.launch_server", *SMALL, "--port", str(port), *args]
        super().__init__(cmd, port, tmp_dir / f"server-{port}-{time.monotonic_ns()}.log", _env())

    def wait_ready(self, timeout_s: float = 90) -> "Server":
        return super().wait_ready(timeout_s)

    def info(self) -> dict:
        return requests.get(self.url + "/get_server_info", timeout=30).json()

    def generate(self, input_ids, max_new_tokens=MAX_NEW) -> dict:
        body = {"input_ids": input_ids,
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}
        r = requests.post(self.url + "/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(dp-size-2 server, dp-size-1 server), started side by side."""
    tmp = tmp_path_factory.mktemp("dp_servers")
    dp2 = Server(tmp, *DP2, *GRAPHS)
    dp1 = Server(tmp, *GRAPHS)
    try:
        yield dp2.wait_ready(), dp1.wait_ready()
    finally:
        dp2.stop()
        dp1.stop()


@pytest.fixture(scope="module")
def dp1_greedy(servers):
    _, dp1 = servers
    return [dp1.generate(p)["output_ids"] for p in PROMPTS]


def _rank_stats(server) -> list:
    return server.info()["dp_rank_stats"]


# ---- serving --------------------------------------------------------------------------------


def test_16_concurrent_requests_finish_with_the_greedy_ids_of_a_dp1_server(servers, dp1_greedy):
    dp2, _ = servers
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(dp2.generate, PROMPTS))
    for prompt, res in zip(PROMPTS, results):
        assert res["meta_info"]["completion_tokens"] == MAX_NEW and len(res["output_ids"]) == MAX_NEW
        assert res["meta_info"]["prompt_tokens"] == len(prompt)
    assert [r["output_ids"] for r in results] == dp1_greedy


def test_server_info_shows_both_ranks_replaying_and_round_robin_splits_requests_evenly(servers):
    dp2, _ = servers
    before = _rank_stats(dp2)
    for p in PROMPTS[:6]:  # one after another: round-robin alternates ranks
        dp2.generate(p)
    info = dp2.info()
    ranks = info["dp_rank_stats"]
    assert info["dp_size"] == 2 and len(ranks) == 2
    assert [r["num_finished_reqs"] - b["num_finished_reqs"] for r, b in zip(ranks, before)] == [3, 3]
    pids = info["scheduler_pids"]
    assert len(set(pids)) == 2 and set(pids) <= set(descendant_pids(dp2.proc.pid))
    total = info["scheduler_stats"]
    for key in ("breakable_replays", "dp_breakable_steps", "dp_eager_steps", "num_finished_reqs", "num_generated_tokens"):
        assert total[key] == ranks[0][key] + ranks[1][key], key
    assert all(r["breakable_replays"] > 0 for r in ranks)
    # lockstep: every step is taken by both ranks (idle ones run a dummy forward)
    assert ranks[0]["dp_breakable_steps"] == ranks[1]["dp_breakable_steps"] > 0
    assert ranks[0]["dp_eager_steps"] == ranks[1]["dp_eager_steps"]


def test_a_client_that_goes_away_aborts_its_request_on_the_rank_that_owns_it(servers):
    dp2, _ = servers
    before = _rank_stats(dp2)
    body = {"input_ids": [3, 4, 5], "stream": True, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
    with requests.post(dp2.url + "/generate", json=body, stream=True, timeout=30) as r:
        assert next(line for line in r.iter_lines() if line.startswith(b"data: "))  # it is running
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        after = _rank_stats(dp2)
        if sum(a["num_aborted_reqs"] - b["num_aborted_reqs"] for a, b in zip(after, before)) == 1:
            break
        time.sleep(0.05)
    aborted = [a["num_aborted_reqs"] - b["num_aborted_reqs"] for a, b in zip(after, before)]
    assert sorted(aborted) == [0, 1]
    assert [a["num_running_reqs"] for a in after] == [0, 0]
    assert after[aborted.index(1)]["num_generated_tokens"] - before[aborted.index(1)]["num_generated_tokens"] < 400


def test_offline_engine_with_dp_size_2_generates_the_dp1_greedy_ids(dp1_greedy):
    from sglang.srt.entrypoints.engine import Engine

    engine = Engine(model_path="dsv4-tiny", device="cpu", enable_dp_attention=True, dp_size=2, context_length=512,
                    max_total_tokens=8192, max_running_requests=16, enable_breakable_cuda_graph=True,
                    enable_mixed_chunk=True, breakable_cuda_graph_tokens=[8, 24, 64, 128], watchdog_timeout=60)
    try:
        outs = engine.generate(input_ids=PROMPTS[:6], sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0,
                                                                      "ignore_eos": True})
        assert [o["output_ids"] for o in outs] == dp1_greedy[:6]
        # logprobs come back from the rank processes with their tokens
        with_lp = engine.generate(input_ids=PROMPTS[:2], sampling_params={"max_new_tokens": 3, "temperature": 0,
                                                                         "ignore_eos": True},
                                  return_logprob=True, top_logprobs_num=2)
        for o in with_lp:
            meta = o["meta_info"]
            assert [t for _, t, _ in meta["output_token_logprobs"]] == o["output_ids"]
            assert [top[0][1] for top in meta["output_top_logprobs"]] == o["output_ids"]  # greedy
        info = engine.get_server_info()
        finished = [r["num_finished_reqs"] for r in info["dp_rank_stats"]]
        assert sum(finished) == 8 and min(finished) >= 3
        assert info["breakable_replays"] > 0
        pids = [p for p in engine.scheduler.controller.pids]
    finally:
        engine.shutdown()
    assert not [p for p in pids if pid_alive(p)]


def test_sigterm_stops_every_rank_and_leaves_no_child(servers):
    dp2, _ = servers
    children = descendant_pids(dp2.proc.pid)
    assert set(dp2.info()["scheduler_pids"]) <= set(children)
    dp2.proc.send_signal(signal.SIGTERM)
    assert dp2.proc.wait(30) == 0
    assert still_alive_after(children) == []
    log = dp2.log()
    assert log.count("scheduler process exiting") == 2  # both left cleanly, graphs released
    assert "ended with exit code" not in log


def _client_outcome(url: str, i: int) -> tuple[str, float]:
    """A long request (streamed for odd i) that the test kills mid-flight: how it ended, and
    when (monotonic seconds)."""
    body = {"input_ids": PROMPTS[i], "stream": bool(i % 2),
            "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}}
    try:
        r = requests.post(url + "/generate", json=body, stream=bool(i % 2), timeout=60)
        if not i % 2:
            return f"http {r.status_code}: {r.text[:200]}", time.monotonic()
        events = [line for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")]
        last = events[-2] if len(events) >= 2 and events[-1] == "data: [DONE]" else (events or ["no events"])[-1]
        return f"stream {r.status_code}: {last[:200]}", time.monotonic()
    except requests.RequestException as e:  # the connection dropped: also an error the client sees
        return f"connection error: {type(e).__name__}", time.monotonic()


def test_kill_9_of_one_rank_under_load_fails_every_client_within_seconds_and_leaves_no_orphan(tmp_path):
    server = Server(tmp_path, *DP2, *GRAPHS).wait_ready()
    try:
        info = server.info()
        children = descendant_pids(server.proc.pid)
        pool = ThreadPoolExecutor(12)
        futures = [pool.submit(_client_outcome, server.url, i) for i in range(12)]
        deadline = time.monotonic() + 60
        while not all(r["num_running_reqs"] for r in _rank_stats(server)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(r["num_running_reqs"] for r in _rank_stats(server)), "both ranks are busy when one dies"
        killed_at = time.monotonic()
        os.kill(info["scheduler_pids"][1], signal.SIGKILL)
        outcomes = [f.result(timeout=60) for f in futures]
        for text, at in outcomes:
            assert at - killed_at < 15, (text, at - killed_at)
            # non-streamed: a 503 naming the rank; streamed: an error event before [DONE]
            assert text.startswith(("http 503", "stream 503", "stream 200: data: {\"error\"", "connection error")), text
            assert "200: {" not in text  # no request reports success after its rank died
        assert any("DP rank 1 exited unexpectedly (exit code -9)" in text for text, _ in outcomes)
        assert server.proc.wait(30) == 1
        assert still_alive_after(children) == []
    finally:
        server.stop()


# ---- two nodes on loopback ------------------------------------------------------------------


def test_two_nodes_serve_least_loaded_and_a_killed_rank_takes_both_down(tmp_path, dp1_greedy):
    rendezvous = f"127.0.0.1:{_free_port_pair()}"
    multi = [*DP2, *GRAPHS, "--nnodes", "2", "--dist-init-addr", rendezvous, "--load-balance-method", "least_loaded"]
    node1 = Server(tmp_path, *multi, "--node-rank", "1")  # headless: its rank connects back to node 0
    node0 = Server(tmp_path, *multi, "--node-rank", "0")
    try:
        node0.wait_ready()
        assert node0.generate(PROMPTS[5])["output_ids"] == dp1_greedy[5]
        info = node0.info()
        rank1_pid = info["scheduler_pids"][1]
        assert rank1_pid in descendant_pids(node1.proc.pid) and rank1_pid not in descendant_pids(node0.proc.pid)

        # least-loaded: while one rank runs a long request, short ones all go to the other
        long_body = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 500, "ignore_eos": True}}
        long_req = ThreadPoolExecutor(1).submit(requests.post, node0.url + "/generate", json=long_body, timeout=60)
        deadline = time.monotonic() + 30
        while sum(r["num_running_reqs"] for r in _rank_stats(node0)) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        before = _rank_stats(node0)
        busy = [r["num_running_reqs"] for r in before].index(1)
        for p in PROMPTS[:3]:
            node0.generate(p)
        after = _rank_stats(node0)
        finished = [a["num_finished_reqs"] - b["num_finished_reqs"] for a, b in zip(after, before)]
        assert finished[busy] == 0 and finished[1 - busy] == 3
        assert after[busy]["num_running_reqs"] == 1  # the long one is still in flight

        # a rank that dies: the in-flight request fails, node 0 exits non-zero, node 1 too
        os.kill(info["scheduler_pids"][0], signal.SIGKILL)
        r = long_req.result(timeout=30)
        assert r.status_code == 503
        assert "DP rank 0 exited unexpectedly (exit code -9)" in r.json()["error"]["message"]
        assert node0.proc.wait(30) == 1
        assert node1.proc.wait(30) == 1
        for pid in info["scheduler_pids"]:
            assert not pid_alive(pid)
    finally:
        node0.stop()
        node1.stop()


def test_sigterm_on_node_0_stops_both_nodes_cleanly(tmp_path):
    rendezvous = f"127.0.0.1:{_free_port_pair()}"
    multi = [*DP2, "--nnodes", "2", "--dist-init-addr", rendezvous]
    node1 = Server(tmp_path, *multi, "--node-rank", "1")
    node0 = Server(tmp_path, *multi, "--node-rank", "0")
    try:
        node0.wait_ready()
        assert node0.generate(PROMPTS[0])["meta_info"]["completion_tokens"] == MAX_NEW
        children = descendant_pids(node0.proc.pid) + descendant_pids(node1.proc.pid)
        node0.proc.send_signal(signal.SIGTERM)
        assert node0.proc.wait(30) == 0
        assert node1.proc.wait(30) == 0  # its rank agreed to stop and left cleanly
        assert still_alive_after(children) == []
        assert "scheduler process exiting" in node1.log()
    finally:
        node0.stop()
        node1.stop()


# ---- start-up errors ------------------------------------------------------------------------


def _launch_fails(*args: str) -> tuple:
    cmd = [sys.executable, "-m", "sglang.launch_server", *SMALL, "--port", str(free_port()), *args]
    r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=90)
    return r.returncode, r.stdout + r.stderr


def test_experts_not_divisible_by_dp_size_fail_at_startup_with_the_reason():
    code, out = _launch_fails("--enable-dp-attention", "--dp-size", "3")
    assert code == 1
    assert "n_routed_experts (8) must be divisible by dp-size (3)" in out


def test_a_rank_that_fails_to_start_fails_startup_with_its_message():
    code, out = _launch_fails(*DP2, "--context-length", "100000")
    assert code == 1
    assert "failed to start: ValueError: --context-length 100000 exceeds the model's max_position_embeddings" in out
    assert "DP rank" in out


def test_argument_errors_exit_with_a_one_line_reason():
    code, out = _launch_fails("--dp-size", "2")
    assert code == 2 and "error: --dp-size > 1 needs --enable-dp-attention" in out
    code, out = _launch_fails(*DP2, "--enable-two-batch-overlap")  # no such flag: TBO is not implemented
    assert code == 2 and "unrecognized arguments: --enable-two-batch-overlap" in out
