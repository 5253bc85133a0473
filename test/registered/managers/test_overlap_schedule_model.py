"""Overlap scheduling on the real model: dsv4-tiny on CPU with breakable graphs and decode
graphs on the emulator (frozen Python, fixed storage: a placeholder that reached a graph's
static input buffer unresolved would change the output), and dsv4-mini on CUDA with real
graphs (`gpu`). Greedy and seeded outputs must be the same with and without overlap."""

import random
import warnings

import pytest
import torch

from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.test.runner_args import cpu_server_args
from sglang.test.kv_accounting import assert_no_request_holds_kv

TINY = dict(model_path="dsv4-tiny", context_length=512, max_total_tokens=4096)
LENGTHS = [5, 40, 70, 3, 20, 9, 130, 1]


def detok(ids):
    return "".join(chr(ord("a") + t % 26) for t in ids)


@pytest.fixture(scope="module")
def graph_runner():
    torch.manual_seed(0)
    return ModelRunner(cpu_server_args(**TINY, max_running_requests=6, enable_breakable_cuda_graph=True,
                                       breakable_cuda_graph_tokens=[8, 32, 64], cuda_graph_max_bs=4),
                       cuda_graph_on_cpu=True)


def make_requests(vocab, max_new_tokens=10, seed=0, lengths=LENGTHS, **params):
    rng = random.Random(seed)
    return [GenerateReqInput(rid=f"r{i}", input_ids=[rng.randrange(2, vocab) for _ in range(n)],
                             sampling_params=SamplingParams(max_new_tokens=max_new_tokens, **params))
            for i, n in enumerate(lengths)]


def serve(runner, reqs, overlap, device="cpu", **kw):
    """Run reqs to the end on a fresh scheduler over `runner`: (rid -> (ids, finish reason),
    stats with "batches", each launched forward's (mode, extend lengths))."""
    args = dict(TINY, device=device, max_running_requests=runner.server_args.max_running_requests,
                max_total_tokens=(runner.req_to_token_pool.pages.capacity) * runner.req_to_token_pool.page_size)
    args.update(kw, disable_overlap_schedule=not overlap)
    s = Scheduler(ServerArgs(**args).resolve(cuda_available=device == "cuda"), runner, decode_fn=detok)
    for r in reqs:
        s.add_request(r)
    res, batches = {}, []
    while s.has_work():
        for o in s.step():
            ids, _ = res.get(o.rid, ([], None))
            res[o.rid] = (ids + o.new_token_ids, o.finish_reason)
        if s.last_batch is not None:
            batches.append((s.last_batch.forward_mode, tuple(s.last_batch.extend_lens)))
    assert_no_request_holds_kv(s)
    return res, dict(s.get_stats(), batches=batches)


@pytest.mark.parametrize("mixed, chunk", [(True, 32), (False, 16), (False, 512)])
def test_greedy_outputs_with_graphs_are_identical_with_and_without_overlap(graph_runner, mixed, chunk):
    vocab = graph_runner.config.vocab_size
    greedy = dict(temperature=0.0, ignore_eos=True)
    probe, _ = serve(graph_runner, make_requests(vocab, **greedy), overlap=False,
                     enable_mixed_chunk=mixed, chunked_prefill_size=chunk)

    def requests():
        reqs = make_requests(vocab, **greedy)
        reqs[0].sampling_params.max_new_tokens = 0
        reqs[3].sampling_params.max_new_tokens = 1
        reqs[1].sampling_params.stop_token_ids = [probe["r1"][0][4]]
        reqs[2].sampling_params.stop = [detok(probe["r2"][0][3:5])]
        return reqs

    before = graph_runner.get_stats()
    on, stats = serve(graph_runner, requests(), overlap=True, enable_mixed_chunk=mixed, chunked_prefill_size=chunk)
    off, _ = serve(graph_runner, requests(), overlap=False, enable_mixed_chunk=mixed, chunked_prefill_size=chunk)
    assert on == off
    assert on["r0"] == ([], {"type": "length", "length": 0}) and len(on["r3"][0]) == 1
    assert on["r1"][1]["type"] == "stop" and on["r2"][1]["type"] == "stop"
    for rid in ("r4", "r5", "r6", "r7"):
        assert on[rid] == probe[rid]
    after = graph_runner.get_stats()
    assert stats["num_overlap_steps"] > 0
    # both graph kinds replayed (so the resolve fed their static buffers), eager ran too
    assert after["decode_graph_replays"] > before["decode_graph_replays"]
    assert after["breakable_replays"] > before["breakable_replays"] or chunk == 512


def test_seeded_sampling_with_graphs_is_the_same_with_and_without_overlap(graph_runner):
    def requests():
        reqs = make_requests(graph_runner.config.vocab_size, max_new_tokens=8, seed=4, temperature=1.0, top_p=0.9)
        for i, r in enumerate(reqs):
            r.sampling_params.seed = 7 + i
        return reqs

    on, _ = serve(graph_runner, requests(), overlap=True, enable_mixed_chunk=True, chunked_prefill_size=32)
    off, _ = serve(graph_runner, requests(), overlap=False, enable_mixed_chunk=True, chunked_prefill_size=32)
    assert on == off and all(len(ids) == 8 for ids, _ in on.values())


def test_retraction_on_the_model_gives_the_no_overlap_outputs():
    # 2 pages of 128 tokens; 3 requests that grow to 150 tokens each: retraction is forced
    runner = ModelRunner(cpu_server_args(**dict(TINY, max_total_tokens=256), max_running_requests=3))
    reqs = lambda: make_requests(runner.config.vocab_size, max_new_tokens=40, lengths=[110, 100, 90],  # noqa: E731
                                 temperature=0.0, ignore_eos=True)
    on, stats = serve(runner, reqs(), overlap=True, chunked_prefill_size=64)
    off, _ = serve(runner, reqs(), overlap=False, chunked_prefill_size=64)
    assert on == off and all(len(ids) == 40 for ids, _ in on.values())
    assert stats["num_retracted_reqs"] >= 1 and stats["num_forced_resolves"] >= 1


MINI_LENGTHS = [5, 300, 17, 64, 1, 200, 33, 90, 128, 7, 250, 40]
MINI_ARGS = dict(model_path="dsv4-mini", context_length=2048, enable_mixed_chunk=True, chunked_prefill_size=256)


@pytest.fixture(scope="module")
def mini_cuda_runner():
    runner = ModelRunner(cpu_server_args(model_path="dsv4-mini", context_length=2048, max_total_tokens=65536,
                                         device="cuda", dtype="bfloat16", max_running_requests=16,
                                         enable_breakable_cuda_graph=True,
                                         breakable_cuda_graph_tokens=[16, 64, 256], cuda_graph_max_bs=16))
    yield runner
    runner.shutdown()


def mini_requests(runner):
    return make_requests(runner.config.vocab_size, max_new_tokens=24, seed=1, lengths=MINI_LENGTHS,
                         temperature=0.0, ignore_eos=True)


@pytest.mark.gpu
def test_gpu_dsv4_mini_greedy_with_breakable_and_decode_graphs_is_the_same_with_and_without_overlap(mini_cuda_runner):
    runner = mini_cuda_runner
    before = runner.get_stats()
    on, stats = serve(runner, mini_requests(runner), overlap=True, device="cuda", **MINI_ARGS)
    off, off_stats = serve(runner, mini_requests(runner), overlap=False, device="cuda", **MINI_ARGS)
    again, _ = serve(runner, mini_requests(runner), overlap=False, device="cuda", **MINI_ARGS)
    after = runner.get_stats()
    # no resource limit binds, so both modes launch the same forwards: any difference below
    # is the overlap path's, not the batch composition's or the kernels'
    assert stats["batches"] == off_stats["batches"]
    assert again == off, "the GPU path is not deterministic run to run: overlap equivalence cannot be judged"
    assert on == off and all(len(ids) == 24 for ids, _ in on.values())
    assert stats["num_overlap_steps"] > 0
    assert after["breakable_replays"] > before["breakable_replays"]
    assert after["decode_graph_replays"] > before["decode_graph_replays"]


@pytest.mark.gpu
def test_gpu_overlapped_steps_never_wait_for_the_gpu(mini_cuda_runner):
    """With overlap nothing in a step may wait for the GPU except reading the previous step's
    ids (an event wait, which sync debug mode does not flag): a hidden sync anywhere in
    scheduling, metadata, replay or sampling would serialise the host behind the GPU again."""
    runner = mini_cuda_runner
    warm, _ = serve(runner, mini_requests(runner), overlap=True, device="cuda", **MINI_ARGS)  # JIT, allocator
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            synced, _ = serve(runner, mini_requests(runner), overlap=True, device="cuda", **MINI_ARGS)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # torch's own notice on entering the mode ("... is a prototype feature ...") is not a sync
    syncs = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught
             if "called a synchronizing CUDA operation" in str(w.message)]
    assert synced == warm
    assert not syncs, f"{len(syncs)} host syncs inside overlapped steps:\n" + "\n".join(syncs[:10])
