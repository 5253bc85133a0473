"""DP serving without processes: argument rules (no two-batch overlap flag), the
controller's choice of rank (round-robin, least-loaded, wake-ups), stats aggregation."""

import pytest

from sglang.srt.managers.dp.controller import DataParallelController
from sglang.srt.managers.dp.stats import aggregate_stats
from sglang.srt.managers.dp.supervisor import controller_address, node_ranks
from sglang.srt.managers.io_struct import GenerateReqInput, TokenOut
from sglang.srt.managers.scheduler_process import WAKE, check_same_args
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.srt.server_args_cli import prepare_server_args

DP2 = dict(enable_dp_attention=True, dp_size=2)


# ---- arguments ------------------------------------------------------------------------------


def test_dp_size_needs_dp_attention():
    with pytest.raises(ValueError, match="--dp-size > 1 needs --enable-dp-attention"):
        ServerArgs(dp_size=2)


def test_dp_size_must_split_evenly_over_nodes():
    with pytest.raises(ValueError, match=r"--dp-size \(3\) must be divisible by --nnodes \(2\)"):
        ServerArgs(enable_dp_attention=True, dp_size=3, nnodes=2, dist_init_addr="127.0.0.1:5000")
    ServerArgs(enable_dp_attention=True, dp_size=4, nnodes=2, dist_init_addr="127.0.0.1:5000")


def test_dist_init_addr_is_host_and_port_and_the_controller_listens_one_above():
    for bad in ("127.0.0.1", "127.0.0.1:http", ":5000", "127.0.0.1:65535"):
        with pytest.raises(ValueError, match="--dist-init-addr must be host:port"):
            ServerArgs(**DP2, nnodes=2, dist_init_addr=bad)
    assert controller_address("10.0.0.7:29500") == ("10.0.0.7", 29501)
    assert controller_address("[::1]:29500") == ("::1", 29501)


def test_a_node_started_with_other_arguments_than_node_0_is_refused_with_the_differences():
    node0 = ServerArgs(**DP2, nnodes=2, dist_init_addr="127.0.0.1:5000", enable_breakable_cuda_graph=True, port=8000)
    same = ServerArgs(**DP2, nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:5000", enable_breakable_cuda_graph=True)
    check_same_args(node0, same, 1)  # node rank and HTTP port are per node
    other = ServerArgs(**DP2, nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:5000", chunked_prefill_size=64)
    with pytest.raises(ValueError) as e:
        check_same_args(node0, other, 1)
    assert str(e.value) == (
        "node 1 was started with other arguments than node 0 (every node needs the same ones): "
        "--chunked-prefill-size (node 0: None, node 1: 64); "
        "--enable-breakable-cuda-graph (node 0: True, node 1: False)")


def test_ranks_are_split_evenly_over_nodes():
    assert [list(node_ranks(8, 2, k)) for k in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert list(node_ranks(2, 1, 0)) == [0, 1]


def test_two_batch_overlap_is_not_a_flag():
    """TBO is not implemented, so no flag or code path pretends it is (docs/dp_attention.md)."""
    with pytest.raises(TypeError):
        ServerArgs(**DP2, enable_two_batch_overlap=True)
    with pytest.raises(SystemExit):
        prepare_server_args(["--enable-dp-attention", "--dp-size", "2", "--enable-two-batch-overlap"])


def _req(rid: str, prompt_len: int = 4, max_new_tokens: int = 8) -> GenerateReqInput:
    params = SamplingParams(max_new_tokens=max_new_tokens)
    return GenerateReqInput(rid=rid, input_ids=[3] * prompt_len, sampling_params=params)


def _done(rid: str) -> TokenOut:
    return TokenOut(rid=rid, new_token_ids=[5], finished=True, finish_reason={"type": "length", "length": 1},
                    prompt_tokens=4, completion_tokens=1)


def _controller(method: str, dp_size: int = 2) -> DataParallelController:
    return DataParallelController(ServerArgs(enable_dp_attention=True, dp_size=dp_size, load_balance_method=method))


def test_round_robin_cycles_through_ranks_whatever_their_load():
    c = _controller("round_robin", dp_size=3)
    assert [c.assign(_req(f"r{i}", max_new_tokens=1000 if i == 0 else 1)) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_least_loaded_picks_the_rank_with_fewest_outstanding_requests_then_tokens():
    c = _controller("least_loaded")
    assert c.assign(_req("long", max_new_tokens=1000)) == 0
    # rank 0 is busy with "long": every short request goes to rank 1 while it runs
    for i in range(3):
        assert c.assign(_req(f"s{i}")) == 1
        c.on_outputs([_done(f"s{i}")])
    assert c.assign(_req("a")) == 1  # rank 0: 1 request, rank 1: 0
    # one request each: tokens decide (rank 0 holds 4 + 1000, rank 1 holds 4 + 8)
    assert c.assign(_req("b", prompt_len=100)) == 1
    c.on_outputs([_done("long"), _done("a"), _done("b")])
    assert c.num_outstanding == 0 and [(x.reqs, x.tokens) for x in c.load] == [(0, 0), (0, 0)]


def test_least_loaded_breaks_ties_by_rotating():
    c = _controller("least_loaded")
    ranks = []
    for i in range(4):
        ranks.append(c.assign(_req(f"r{i}")))
        c.on_outputs([_done(f"r{i}")])
    assert ranks == [0, 1, 0, 1]


def test_a_request_reaching_an_idle_server_wakes_the_other_ranks():
    c = _controller("round_robin", dp_size=3)
    a, b = _req("a"), _req("b")
    assert c.route(a) == [(0, a), (1, WAKE), (2, WAKE)]
    assert c.route(b) == [(1, b)]  # "a" is outstanding: the ranks are stepping anyway
    c.on_outputs([_done("a"), _done("b")])
    d = _req("d")
    assert c.route(d) == [(2, d), (0, WAKE), (1, WAKE)]


def test_unfinished_outputs_keep_the_request_outstanding_and_late_outputs_are_ignored():
    c = _controller("least_loaded")
    c.assign(_req("a"))
    c.on_outputs([TokenOut("a", [1], False, None, 4, 1)])
    assert c.owner_of("a") == 0
    c.on_outputs([_done("a")])
    assert c.owner_of("a") is None
    c.on_outputs([_done("a"), _done("never-sent")])  # an abort's late final output
    assert [(x.reqs, x.tokens) for x in c.load] == [(0, 0), (0, 0)]


# ---- stats ---------------------------------------------------------------------------------


def test_stats_sum_counters_merge_fallbacks_and_keep_shared_settings():
    r0 = {"breakable_replays": 5, "breakable_fallbacks": {"too_many_tokens": 1}, "dp_breakable_steps": 7, "dp_eager_steps": 3,
          "page_size": 128, "breakable_buckets": [16, 64], "breakable_capture_seconds": 1.5, "num_finished_reqs": 4}
    r1 = {"breakable_replays": 6, "breakable_fallbacks": {"too_many_tokens": 2, "padding_waste": 1}, "dp_breakable_steps": 7,
          "dp_eager_steps": 3, "page_size": 128, "breakable_buckets": [16, 64], "breakable_capture_seconds": 2.0,
          "num_finished_reqs": 5}
    assert aggregate_stats([r0, r1]) == {
        "breakable_replays": 11, "breakable_fallbacks": {"too_many_tokens": 3, "padding_waste": 1}, "dp_breakable_steps": 14,
        "dp_eager_steps": 6, "page_size": 128, "breakable_buckets": [16, 64], "breakable_capture_seconds": 2.0,
        "num_finished_reqs": 9,
    }
    assert aggregate_stats([r0]) == r0


def test_stats_per_bucket_graph_memory_sums_and_capture_seconds_take_the_slowest_rank():
    r0 = {"breakable_graph_memory_by_bucket": {"64": 300, "16": 20}, "breakable_capture_seconds_by_bucket": {"64": 1.0, "16": 0.5}}
    r1 = {"breakable_graph_memory_by_bucket": {"64": 310, "16": 0}, "breakable_capture_seconds_by_bucket": {"64": 1.5, "16": 0.25}}
    merged = aggregate_stats([r0, r1])
    assert merged == {"breakable_graph_memory_by_bucket": {"64": 610, "16": 20},
                      "breakable_capture_seconds_by_bucket": {"64": 1.5, "16": 0.5}}
    assert list(merged["breakable_graph_memory_by_bucket"]) == ["64", "16"]  # capture order kept


def test_kv_capacity_sums_over_ranks_and_bytes_per_token_is_reported_once():
    rank = {"kv_cache_dtype": "fp8_e4m3", "kv_bytes_per_token": 5312, "kv_capacity_tokens": 65536,
            "kv_capacity_requests": 16}
    assert aggregate_stats([rank, dict(rank, kv_capacity_tokens=32768, kv_capacity_requests=8)]) == {
        "kv_cache_dtype": "fp8_e4m3", "kv_bytes_per_token": 5312, "kv_capacity_tokens": 98304,
        "kv_capacity_requests": 24}
