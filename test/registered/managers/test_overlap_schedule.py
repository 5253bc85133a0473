"""Overlap scheduling on CPU with test_scheduler.py's fake runner (which really reads and writes
the KV cache through the page table, so a wrong placeholder resolve or a freed-too-early page
changes the output): the same outputs with and without overlap, the one-step lag and nothing
more, the dropped token after a stop, abort and retraction while a step is in flight, seeded
sampling, and the future map itself."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_scheduler import (  # noqa: E402
    collect,
    create_requests,
    create_scheduler,
    reference,
    run,
)

from sglang.srt.managers.overlap import FutureMap  # noqa: E402
from sglang.test.kv_accounting import assert_no_request_holds_kv  # noqa: E402


def traced_run(s, reqs, max_steps=5000):
    """Like run(), also recording per step() call the rids whose tokens that call's forward
    sampled and the rids whose final TokenOut it returned."""
    sampled, finished = [], {}
    original = s._sample

    def sample(batch, logits):
        step = original(batch, logits)
        sampled[-1] = [r.rid for r in step.reqs]
        return step

    s._sample = sample
    for r in reqs:
        s.add_request(r)
    results = {}
    for call in range(max_steps):
        if not s.has_work():
            break
        sampled.append([])
        outs = s.step()
        collect(outs, results)
        finished.update({o.rid: call for o in outs if o.finished})
    assert not s.has_work()
    assert_no_request_holds_kv(s)
    return results, sampled, finished


def outputs(results):
    return {rid: (r["output_ids"], r["finish_reason"], r["completion_tokens"]) for rid, r in results.items()}


def both(reqs_fn, **kw):
    """(overlap results, no-overlap results, overlap scheduler)."""
    on = create_scheduler(**kw)
    off = create_scheduler(disable_overlap_schedule=True, **kw)
    assert on.overlap and not off.overlap
    return run(on, reqs_fn()), run(off, reqs_fn()), on


def _mixed_bag():
    """Many lengths, max_new_tokens 0 and 1, a stop token and a stop string, eos."""
    reqs = create_requests(12, [5, 40, 130, 7, 260, 1, 64, 3, 90, 17, 200, 11], max_new_tokens=9, seed=3)
    reqs[1].sampling_params.max_new_tokens = 0
    reqs[2].sampling_params.max_new_tokens = 1
    reqs[3].sampling_params.stop_token_ids = [reference(reqs[3].input_ids, 9)[4]]
    reqs[4].sampling_params.stop = ["".join(chr(ord("a") + (t - 2) % 26) for t in reference(reqs[4].input_ids, 9)[2:4])]
    reqs[5].sampling_params.max_new_tokens = 30
    for r in reqs[6:]:
        r.sampling_params.ignore_eos = True
    return reqs


@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("chunk", [16, 256])
def test_greedy_outputs_are_identical_with_and_without_overlap(mixed, chunk):
    on, off, s = both(_mixed_bag, enable_mixed_chunk=mixed, chunked_prefill_size=chunk)
    assert outputs(on) == outputs(off)
    for r in _mixed_bag():
        n = on[r.rid]["completion_tokens"]
        assert on[r.rid]["output_ids"] == reference(r.input_ids, n)
    assert on["r1"]["output_ids"] == [] and on["r1"]["finish_reason"] == {"type": "length", "length": 0}
    assert on["r2"]["output_ids"] == reference(_mixed_bag()[2].input_ids, 1)
    assert on["r3"]["finish_reason"]["type"] == "stop" and on["r4"]["finish_reason"]["type"] == "stop"
    stats = s.get_stats()
    assert stats["overlap_schedule"] and stats["num_overlap_steps"] > 0


@pytest.mark.parametrize("overlap", [True, False])
def test_finish_lags_at_most_one_step_and_the_extra_token_is_dropped(overlap):
    # mixed chunk: decode rows run every step, so a stop is always followed by a launch
    s = create_scheduler(chunked_prefill_size=64, enable_mixed_chunk=True, disable_overlap_schedule=not overlap)
    reqs = _mixed_bag()
    for r in reqs:
        r.stream = True
    results, sampled, finished = traced_run(s, reqs)
    dropped = 0
    for r in reqs:
        n = results[r.rid]["completion_tokens"]
        assert results[r.rid]["output_ids"] == reference(r.input_ids, n)  # streamed pieces: no extra token
        calls = [c for c, rids in enumerate(sampled) if r.rid in rids]
        assert len(calls) in (n, n + 1)
        if n:
            # the finish is reported by the call that sampled the last token, or the next one
            assert finished[r.rid] - calls[n - 1] == (1 if overlap else 0)
        if len(calls) == n + 1:  # sampled after its stop: only a stop seen one step late does this
            assert overlap and results[r.rid]["finish_reason"]["type"] == "stop"
            assert calls[n] == calls[n - 1] + 1
            dropped += 1
    assert s.get_stats()["num_dropped_tokens"] == dropped
    assert (dropped > 0) == overlap  # r3 (stop token) and r4 (stop string) decode past their stop
    # length finishes are known without the ids: never scheduled past max_new_tokens
    assert all(rids.count("r5") <= 1 for rids in sampled)


def test_abort_while_its_step_is_in_flight_frees_every_page_and_spares_the_others():
    s = create_scheduler(chunked_prefill_size=64)
    assert s.pool.num_free_pages == s.pool.pages.capacity and s.pool.slots.num_free == s.pool.slots.capacity
    reqs = create_requests(4, [30, 400, 20, 40], max_new_tokens=12, seed=5)
    for r in reqs:
        s.add_request(r)
    results = {}
    for _ in range(4):
        collect(s.step(), results)
    victim = s._live["r0"]
    assert s._inflight is not None and victim in s._inflight.reqs and victim.pending_ids  # its token is in flight
    known = list(victim.output_ids)
    assert s.abort_request("r0")
    # r1 (400 tokens, chunks of 64) is mid-prefill: abort it while a chunk of it is in flight
    while not (s.chunked_req is not None and s.chunked_req.rid == "r1" and s.last_batch.reqs[0].rid == "r1"):
        collect(s.step(), results)
    assert s.abort_request("r1")
    while s.has_work():
        collect(s.step(), results)
    assert_no_request_holds_kv(s)  # aborted requests insert nothing; the others' prefixes stay cached
    assert results["r0"]["finish_reason"]["type"] == "abort"
    assert results["r0"]["output_ids"] == known == reference(reqs[0].input_ids, len(known))  # in-flight token dropped
    assert results["r1"]["output_ids"] == [] and results["r1"]["finish_reason"]["type"] == "abort"
    assert s.get_stats()["num_dropped_tokens"] == 1
    for r in reqs[2:]:
        assert results[r.rid]["output_ids"] == reference(r.input_ids, 12)


@pytest.mark.parametrize("mixed", [False, True])
def test_retraction_during_overlap_gives_the_no_overlap_outputs(mixed):
    # 3 pages of 128 tokens; each request grows to 160 tokens (2 pages): retraction is forced
    make = lambda: create_requests(4, 100, max_new_tokens=60, ignore_eos=True, seed=9)  # noqa: E731
    on, off, s = both(make, max_total_tokens=384, enable_mixed_chunk=mixed)
    assert outputs(on) == outputs(off)
    for r in make():
        assert on[r.rid]["output_ids"] == reference(r.input_ids, 60)
    stats = s.get_stats()
    assert stats["num_retracted_reqs"] >= 2 and stats["num_forced_resolves"] >= 1


def test_seeded_sampling_is_the_same_with_and_without_overlap():
    def make():
        reqs = create_requests(6, [9, 33, 4, 70, 12, 5], max_new_tokens=15, seed=11, ignore_eos=True)
        for i, r in enumerate(reqs):
            r.sampling_params.temperature, r.sampling_params.seed = 1.0, 100 + i
        return reqs

    on, off, _ = both(make, chunked_prefill_size=32)
    assert outputs(on) == outputs(off)
    greedy = [reference(r.input_ids, 15) for r in make()]
    assert [on[f"r{i}"]["output_ids"] for i in range(6)] != greedy  # it really sampled


def test_server_args_flag_defaults_to_overlap_and_is_validated():
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.server_args_cli import prepare_server_args

    assert ServerArgs().disable_overlap_schedule is False
    assert prepare_server_args(["--disable-overlap-schedule"]).disable_overlap_schedule is True
    with pytest.raises(ValueError, match="--disable-overlap-schedule must be true or false"):
        ServerArgs(disable_overlap_schedule="no")


def test_future_map_resolves_placeholders_of_alternating_steps():
    fm = FutureMap(4, "cpu")
    a = fm.store(torch.tensor([7, 8, 9]))
    b = fm.store(torch.tensor([5]))
    assert a == 1 and b == 5
    ids = torch.tensor([3, -a, -(a + 2), 0, -b])
    assert fm.resolve(ids).tolist() == [3, 7, 9, 0, 5]
    assert fm.store(torch.tensor([1, 2])) == a  # the first half again, two steps later
    assert fm.resolve(torch.tensor([-a, -(a + 1), -b])).tolist() == [1, 2, 5]
    with pytest.raises(ValueError, match="5 sampled rows in one step, the future map holds 4"):
        fm.store(torch.arange(5))
