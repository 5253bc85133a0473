"""graph_dispatch: the one graph-or-eager decider, for a single rank and for DP alike."""

from __future__ import annotations

import random

import pytest
import torch

from sglang.srt.model_executor.forward_batch_info import ForwardMode, build_forward_batch
from sglang.srt.model_executor.graph_dispatch import (
    GraphTables,
    PathKind,
    StepInfo,
    decide_step_path,
    default_capture_bs,
    default_capture_num_tokens,
    describe,
    has_inactive_dp_rank,
    requested_eager_path,
)
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.test.runner_args import cpu_server_args

TABLES = GraphTables(breakable_buckets=(8, 16, 64), decode_bs_buckets=(1, 2, 4, 8))


def ext(n, mode=ForwardMode.EXTEND):
    return StepInfo(n, int(mode), 1)


def dec(bs, embeds=False):
    return StepInfo(bs, int(ForwardMode.DECODE), bs, embeds)


IDLE = StepInfo(0, int(ForwardMode.IDLE), 0)


def kb(path):
    return path.kind, path.size


def test_one_rank_paths_and_reasons():
    assert kb(decide_step_path([ext(7)], TABLES)) == (PathKind.BREAKABLE, 8)
    assert kb(decide_step_path([ext(16, ForwardMode.MIXED)], TABLES)) == (PathKind.BREAKABLE, 16)
    assert kb(decide_step_path([dec(3)], TABLES)) == (PathKind.DECODE_GRAPH, 4)
    too_big = decide_step_path([ext(65)], TABLES)
    assert (too_big.kind, too_big.reason, too_big.wanted) == (PathKind.EAGER, "too_many_tokens", PathKind.BREAKABLE)
    assert decide_step_path([dec(9)], TABLES).reason == "batch_too_large"
    assert decide_step_path([dec(2, embeds=True)], TABLES).reason == "input_embeds"
    # 17 tokens would pad to 64: 47 padding rows > 2 * 17
    assert decide_step_path([ext(17)], TABLES).reason == "padding_waste"
    assert kb(decide_step_path([ext(22)], TABLES)) == (PathKind.BREAKABLE, 64)  # 42 <= 44
    # a kind with no captured graphs is no fallback: nothing is counted against it
    none = decide_step_path([dec(2)], GraphTables(breakable_buckets=(8,)))
    assert (none.kind, none.reason, none.wanted) == (PathKind.EAGER, "no_graphs", None)


def test_dp_applies_the_padding_waste_rule_of_the_largest_rank():
    assert decide_step_path([ext(17), ext(3)], TABLES).reason == "padding_waste"
    assert decide_step_path([ext(3), ext(17)], TABLES).reason == "padding_waste"
    assert kb(decide_step_path([ext(30), ext(3)], TABLES)) == (PathKind.BREAKABLE, 64)
    assert decide_step_path([ext(17), IDLE], TABLES).reason == "padding_waste"


def test_has_inactive_dp_rank_truth_table():
    """True when some rank has no tokens this step (idle, or an empty batch), whatever the
    others do; all ranks idle counts too, though the decider returns IDLE before asking."""
    empty_extend = StepInfo(0, int(ForwardMode.EXTEND), 0)
    assert has_inactive_dp_rank([ext(20), IDLE]) is True
    assert has_inactive_dp_rank([IDLE, dec(3)]) is True
    assert has_inactive_dp_rank([ext(20), empty_extend]) is True
    assert has_inactive_dp_rank([ext(20), dec(3)]) is False
    assert has_inactive_dp_rank([ext(7)]) is False  # a world of one with work
    assert has_inactive_dp_rank([IDLE, IDLE]) is True
    assert decide_step_path([IDLE, IDLE], GraphTables((8,), (), "eager")).kind == PathKind.IDLE


def test_the_idle_policy_decides_what_an_inactive_rank_does():
    """The guard is asked only under idle policy "eager": then a step with an inactive rank
    runs eager on every rank (counted against the kind it would have used); under "replay"
    the inactive rank replays padded, and all-active steps are the same under both."""
    eager_policy = GraphTables(TABLES.breakable_buckets, TABLES.decode_bs_buckets, "eager")
    for infos, kind in (([ext(16), IDLE], PathKind.BREAKABLE), ([IDLE, dec(3)], PathKind.DECODE_GRAPH)):
        fallback = decide_step_path(infos, eager_policy)
        assert (fallback.kind, fallback.reason, fallback.wanted) == (PathKind.EAGER, "inactive_dp_rank", kind)
        assert decide_step_path(infos, TABLES).kind == kind
    assert kb(decide_step_path([ext(16), dec(3)], eager_policy)) == (PathKind.BREAKABLE, 16)


def test_a_single_rank_and_dp_decide_identically_on_the_same_batches():
    """Random batches: a world of one, and a DP world whose other ranks are idle or
    smaller, reach the same kind, bucket and reason (the rank with the most work sets both)."""
    rng = random.Random(0)
    modes = [ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DECODE]
    for _ in range(2000):
        mode = rng.choice(modes)
        n = rng.randint(1, 80)
        mine = dec(min(n, 12), rng.random() < 0.1) if mode == ForwardMode.DECODE else ext(n, mode)
        others = []
        for _ in range(rng.randint(1, 3)):
            if rng.random() < 0.3:
                others.append(IDLE)
            elif mode == ForwardMode.DECODE:
                others.append(dec(rng.randint(1, mine.batch_size), mine.has_input_embeds))
            else:
                others.append(ext(rng.randint(1, mine.num_tokens), rng.choice(modes[:2])))
        alone = decide_step_path([mine], TABLES)
        for world in ([mine] + others, others + [mine]):
            together = decide_step_path(world, TABLES)
            assert (together.kind, together.size, together.reason) == (alone.kind, alone.size, alone.reason)


def test_requested_eager_path_is_eager_for_every_rank_and_no_fallback():
    p = requested_eager_path([ext(40), IDLE, dec(3)], TABLES)
    assert (p.kind, p.size, p.global_num_tokens) == (PathKind.EAGER, 40, (40, 0, 3))
    assert p.extend_or_mixed and p.reason == "requested" and p.wanted is None
    p = requested_eager_path([dec(2), dec(5)], TABLES)  # graph-eligible, still eager
    assert (p.kind, p.size, p.extend_or_mixed) == (PathKind.EAGER, 5, False)
    assert requested_eager_path([IDLE, IDLE], TABLES).kind == PathKind.IDLE


def test_bucket_tables():
    tok = default_capture_num_tokens(4096)
    assert tok[:4] == [1, 2, 4, 8] and tok[-1] == 4096
    assert all(b <= 2 * a for a, b in zip(tok, tok[1:]))  # padding never exceeds the live count
    assert default_capture_bs(20) == [1, 2, 4, 8, 12, 16, 20]
    with pytest.raises(ValueError, match="breakable_buckets"):
        GraphTables(breakable_buckets=(16, 8))
    with pytest.raises(ValueError, match="idle_policy"):
        GraphTables(idle_policy="sometimes")


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(cpu_server_args(model_path="dsv4-tiny", context_length=512, max_total_tokens=4096,
                                       max_running_requests=6, enable_breakable_cuda_graph=True,
                                       breakable_cuda_graph_tokens=[4, 32], cuda_graph_max_bs=2),
                       cuda_graph_on_cpu=True)


def _batch(runner, chunks, mode=ForwardMode.EXTEND, prefixes=None):
    rtp = runner.req_to_token_pool
    slots = [rtp.alloc_req() for _ in chunks]
    prefixes = prefixes or [0] * len(chunks)
    for s, p, c in zip(slots, prefixes, chunks):
        rtp.ensure_capacity(s, p + len(c))
    fb = build_forward_batch(mode, slots, prefixes, chunks, "cpu")
    for s in slots:
        rtp.free_req(s)
    return fb


def test_model_runner_runs_what_the_dispatch_decides_and_counts_per_bucket(runner):
    assert runner.graph_tables == GraphTables((4, 32), (1, 2), "replay")
    before = runner.get_stats()
    runner.forward(_batch(runner, [[5, 6, 7]]))  # 3 tokens -> bucket 4
    runner.forward(_batch(runner, [[5] * 9, [6] * 8]))  # 17 -> 32
    runner.forward(_batch(runner, [[5] * 9]))  # 9 would pad to 32: 23 > 18, eager
    runner.forward(_batch(runner, [[5]], ForwardMode.DECODE, prefixes=[4]))  # decode graph bs 1
    runner.forward(_batch(runner, [[5]] * 3, ForwardMode.DECODE, prefixes=[4] * 3))  # 3 > 2: eager
    stats = runner.get_stats()
    assert stats["breakable_replays_by_bucket"] == {"4": 1, "32": 1}
    assert stats["breakable_fallbacks"] == {"padding_waste": 1}
    assert stats["decode_graph_replays_by_bucket"] == {"1": 1}
    assert stats["decode_graph_fallbacks"] == {"batch_too_large": 1}
    assert stats["forward_eager"] - before["forward_eager"] == 2


def test_decode_graphs_capture_exactly_the_given_batch_sizes():
    runner = ModelRunner(cpu_server_args(model_path="dsv4-tiny", context_length=512, max_total_tokens=4096,
                                         max_running_requests=6, cuda_graph_bs=[4, 1]), cuda_graph_on_cpu=True)
    assert runner.decode_graph_runner.buckets == [1, 4] and runner.graph_tables.decode_bs_buckets == (1, 4)
    runner.forward(_batch(runner, [[5]] * 3, ForwardMode.DECODE, prefixes=[4] * 3))  # 3 -> bucket 4
    runner.forward(_batch(runner, [[5]] * 5, ForwardMode.DECODE, prefixes=[4] * 5))  # 5 > 4: eager
    stats = runner.get_stats()
    assert stats["decode_graph_replays_by_bucket"] == {"4": 1}
    assert stats["decode_graph_fallbacks"] == {"batch_too_large": 1}


def test_forward_refuses_a_path_it_cannot_run(runner):
    from sglang.srt.model_executor.graph_dispatch import StepPath

    fb = _batch(runner, [[5, 6]])
    with pytest.raises(ValueError, match="IDLE"):
        runner.forward(fb, StepPath(PathKind.IDLE, 0, (0,)))
    eager_only = ModelRunner(cpu_server_args(model_path="dsv4-tiny", context_length=512, max_total_tokens=4096,
                                             max_running_requests=2))
    with pytest.raises(ValueError, match="no such graphs"):
        eager_only.forward(fb, StepPath(PathKind.BREAKABLE, 4, (2,), True))
    assert describe(fb) == StepInfo(2, int(ForwardMode.EXTEND), 1, False)
    assert torch.isfinite(eager_only.forward(_batch(eager_only, [[5, 6]])).next_token_logits).all()


def test_metrics_label_the_graph_kinds_breakable_and_decode_graph(runner):
    """/metrics derives the `kind` label from the runners' stats prefixes."""
    from prometheus_client.parser import text_string_to_metric_families

    from sglang.srt.metrics import ServerMetrics

    runner.forward(_batch(runner, [[5, 6, 7]]))  # breakable bucket 4
    runner.forward(_batch(runner, [[5] * 9]))  # padding_waste: eager, counted against breakable
    runner.forward(_batch(runner, [[5]], ForwardMode.DECODE, prefixes=[4]))  # decode graph bs 1
    stats = runner.get_stats()
    metrics = ServerMetrics()
    metrics.observe_schedulers([stats])
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(metrics.render()[0].decode())
               for s in family.samples}
    replays = {dict(labels)["kind"] for name, labels in samples if name == "sglang:graph_replays_total"}
    assert replays == {"breakable", "decode_graph"}
    key = ("sglang:graph_fallbacks_total", (("dp_rank", "0"), ("kind", "breakable"), ("reason", "padding_waste")))
    assert samples[key] == stats["breakable_fallbacks"]["padding_waste"] >= 1
    key = ("sglang:graph_replays_total", (("bucket", "4"), ("dp_rank", "0"), ("kind", "breakable")))
    assert samples[key] == stats["breakable_replays_by_bucket"]["4"] >= 1
