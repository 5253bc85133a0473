"""Chained MTP modules: a checkpoint that ships two (`mtp.0`, `mtp.1`), made from DeepSeek's
conformance checkpoint by adding a second module built from its ratio-4 layer 1 (so the second
module has compressor and indexer rings to roll back). CPU, fp32.

Draft step s runs module min(s, 2) - 1: the first draft is module 0's, the second module 1's
on module 0's output one position back, the third module 1 again on its own output. Module 1
keeps exact history: its input at a request's first committed position of a step is module
0's output carried from the previous step (DSV4KVPool.mtp_carry)."""

import os
import random
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.model_executor.forward_batch_info import ForwardMode, build_forward_batch
from sglang.srt.model_executor.graph_dispatch import PathKind
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.test.mtp_checkpoints import write_two_module_checkpoint
from sglang.test.runner_args import cpu_server_args
from sglang.test.scheduler_runs import serve_all
from sglang.test.speculative_drafts import reference_drafts

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")
SOURCE = Path(os.environ.get("DSV4_REFERENCE_DIR") or Path(__file__).parents[2] / "data" / "dsv4-reference") \
    / "conformance-tiny"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    return str(write_two_module_checkpoint(SOURCE, tmp_path_factory.mktemp("two-mtp-modules")))


BASE = dict(context_length=512, max_total_tokens=4096, page_size=128, max_running_requests=32,
            chunked_prefill_size=64, disable_overlap_schedule=True)


def _runner(ckpt, **kw):
    return ModelRunner(cpu_server_args(model_path=ckpt, **dict(BASE, **kw)))


@pytest.fixture(scope="module")
def plain_runner(ckpt):
    return _runner(ckpt)


@pytest.fixture(scope="module")
def spec_runner(ckpt):
    return _runner(ckpt, speculative_algorithm="mtp", speculative_num_steps=3)


def _req(rid, ids, n=24):
    return GenerateReqInput(rid=rid, input_ids=list(ids), return_logprob=True,
                            sampling_params=SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))


def _scheduler(ckpt, runner, **kw):
    args = dict(BASE, model_path=ckpt, max_running_requests=runner.server_args.max_running_requests)
    args.update(kw)
    if runner.num_mtp_layers:
        args.update(speculative_algorithm="mtp", speculative_num_steps=runner.server_args.speculative_num_steps)
    return Scheduler(ServerArgs(**args).resolve(cuda_available=args.get("device") == "cuda"), runner)


def _serve(ckpt, runner, reqs, override=None, **kw):
    return serve_all(_scheduler(ckpt, runner, **kw), reqs, override)


def _same(got, expect):
    assert set(got) == set(expect)
    for rid in expect:
        assert got[rid][0] == expect[rid][0], rid
        torch.testing.assert_close(torch.tensor(got[rid][1]), torch.tensor(expect[rid][1]), atol=1e-4, rtol=0)


LENGTHS = [5, 9, 63, 64, 126, 130, 200]


def _prompts(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(2, 512) for _ in range(n)] for n in lengths]


def test_the_modules_speculation_runs_are_built_loaded_and_cached(ckpt, spec_runner):
    """k = 3 runs both modules, each with its own caches (module 1's ratio-4 rings too) and a
    carried row per request slot; k = 1 builds only the first, whose drafts are all it needs."""
    model = spec_runner.model
    assert len(model.mtp) == 2 and spec_runner.num_mtp_layers == 2
    with safe_open(str(SOURCE / "model.safetensors"), "pt") as f:
        for name in ("attn.compressor.wkv.weight", "attn.indexer.wq_b.weight", "ffn.gate.weight"):
            assert torch.equal(model.mtp[1].get_parameter(name), f.get_tensor(f"layers.1.{name}").float()), name
    pool = spec_runner.kv_pool
    assert len(pool.raw) == 4 + 2 and 5 in pool.compressor_state and 5 in pool.indexer_state
    assert tuple(pool.mtp_carry.shape) == (32 + 1, 1, 4, 128)
    one = _runner(ckpt, speculative_algorithm="mtp", speculative_num_steps=1)
    assert len(one.model.mtp) == 1 and one.kv_pool.mtp_carry is None and len(one.kv_pool.raw) == 5


@pytest.fixture(scope="module")
def expected(ckpt, plain_runner):
    return _serve(ckpt, plain_runner, [_req(f"r{n}", p) for n, p in zip(LENGTHS, _prompts(LENGTHS))])[0]


@pytest.mark.parametrize("k", [2, 3])
def test_chained_drafts_give_the_plain_greedy_outputs(ckpt, expected, k):
    """The modules' own drafts (mostly rejected) and drafts wrong at a varying offset (partly
    accepted, so rejected spans cross module 1's ratio-4 blocks and window): the outputs and
    logprobs of plain decoding."""
    runner = _runner(ckpt, speculative_algorithm="mtp", speculative_num_steps=k)
    reqs = lambda: [_req(f"r{n}", p) for n, p in zip(LENGTHS, _prompts(LENGTHS))]  # noqa: E731
    got, stats = _serve(ckpt, runner, reqs())
    _same(got, expected)
    assert stats["spec_draft_tokens"] > 0
    prompts = {tuple(p): f"r{n}" for n, p in zip(LENGTHS, _prompts(LENGTHS))}
    oracle = reference_drafts(lambda req: expected[prompts[tuple(req.origin_input_ids)]][0],
                              lambda pos: random.Random(pos).randrange(k + 1))
    got, stats = _serve(ckpt, runner, reqs(), override=oracle)
    _same(got, expected)
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]


def _reference_drafts(runner, tokens, L):
    """The three drafts after L committed tokens, computed in a fresh request slot from
    scratch: the target and both modules over positions [0, L) in chunks (module 1 on module
    0's output one position back, zeros before position 0), then module 1 at L on module 0's
    output at L - 1 and the first draft, and again at L + 1 on its own output and the second."""
    pool = runner.req_to_token_pool
    slot = pool.alloc_req()
    pool.ensure_capacity(slot, L + 2)
    c = runner.config
    out0, final0 = [], None
    for a in range(0, L, 64):
        b = min(a + 64, L)
        runner.forward_hidden(build_forward_batch(ForwardMode.EXTEND, [slot], [a], [tokens[a:b]], "cpu"))
        streams = runner.model.streams_out[:b - a].clone()
        o, final0 = runner.forward_mtp(build_forward_batch(ForwardMode.EXTEND, [slot], [a], [tokens[a + 1:b + 1]],
                                                           "cpu"), streams, k=0)
        out0.append(o[:b - a].clone())
    out0 = torch.cat(out0)
    shifted = torch.cat([torch.zeros(1, c.hc_mult, c.hidden_size), out0[:-1]])
    for a in range(0, L, 64):
        b = min(a + 64, L)
        runner.forward_mtp(build_forward_batch(ForwardMode.EXTEND, [slot], [a], [tokens[a + 1:b + 1]], "cpu"),
                           shifted[a:b], k=1)
    # position L - 1 is row (L - 1) % 64 of the last chunk
    drafts = [runner.model.compute_logits(final0[(L - 1) % 64][None]).argmax(-1).item()]
    streams = out0[L - 1:L]
    for step in range(2):
        fb = build_forward_batch(ForwardMode.DECODE, [slot], [L + step], [[drafts[-1]]], "cpu")
        streams, final = runner.forward_mtp(fb, streams, k=1)
        streams = streams[:1].clone()
        drafts.append(runner.model.compute_logits(final[:1]).argmax(-1).item())
    pool.free_req(slot)
    return drafts


def test_each_step_drafts_what_the_chain_computes_over_the_committed_sequence(ckpt, spec_runner):
    """Every step's drafts (with partly accepted verify rows, so the committed length grows by
    1 to 4 a step) equal the chain run from scratch over the committed tokens: module 1's
    caches hold exact history of committed positions only (the carried row bridges the
    steps; the tentative draft positions were rolled back)."""
    prompt = _prompts([70], seed=9)[0]
    plain, _ = _serve(ckpt, _runner(ckpt), [_req("x", prompt, n=40)])
    s = _scheduler(ckpt, spec_runner)
    s.speculator.draft_override = reference_drafts(lambda req: plain["x"][0],
                                                   lambda pos: random.Random(pos).randrange(4))
    s.add_request(_req("x", prompt, n=40))
    seen, req = [], None  # (committed length, the drafts the modules proposed)
    while s.has_work():
        s.step()
        for r in s.running:
            req = r
            seen.append((r.prefix_len, list(r.spec_drafts)))
    tokens = prompt + req.output_ids
    assert len(seen) > 8 and len({L - prev for (L, _), (prev, _) in zip(seen[1:], seen)}) > 2
    for L, drafts in seen[::3]:
        assert drafts == _reference_drafts(spec_runner, tokens, L), L


def test_graphs_replay_every_module_with_the_eager_drafts(ckpt, expected):
    """With graphs on the CPU emulator each module replays its own graphs (the inputs' buffer
    shared per kind): both the breakable ones of the pass over committed positions, module 1
    alone the decode graphs of the draft steps. The drafts equal the eager run's."""
    args = dict(BASE, model_path=ckpt, speculative_algorithm="mtp", speculative_num_steps=3,
                enable_breakable_cuda_graph=True, breakable_cuda_graph_tokens=[16, 64], cuda_graph_max_bs=8)
    graphs = ModelRunner(cpu_server_args(**args), cuda_graph_on_cpu=True)
    eager = _runner(ckpt, speculative_algorithm="mtp", speculative_num_steps=3)
    runners = graphs.mtp_graph_runners
    assert set(runners) == {(0, PathKind.BREAKABLE), (1, PathKind.BREAKABLE), (1, PathKind.DECODE_GRAPH)}
    assert runners[(0, PathKind.BREAKABLE)].streams_in is runners[(1, PathKind.BREAKABLE)].streams_in
    reqs = lambda: [_req(f"r{n}", p) for n, p in zip(LENGTHS, _prompts(LENGTHS))]  # noqa: E731
    logs = {}
    for name, runner in (("eager", eager), ("graphs", graphs)):
        log = logs[name] = {}

        def record(req, pos, drafts, log=log):
            log[(req.rid, pos)] = list(drafts)
            return drafts
        got, stats = _serve(ckpt, runner, reqs(), override=record, max_running_requests=8)
        _same(got, expected)
    assert len(logs["graphs"]) > 50 and logs["graphs"] == logs["eager"]
    assert stats["mtp_breakable_replays"] == stats["mtp1_breakable_replays"] > 0
    assert stats["mtp1_decode_graph_replays"] > 0 and "mtp_decode_graph_replays" not in stats
    graphs.shutdown()


def test_a_resumed_request_drafts_as_if_it_had_computed_the_prefix(ckpt, spec_runner):
    """A second chat turn resumed from the first turn's cached pages and state (module 1's rings
    and the carried row included) drafts exactly what the same turn drafts without a cache."""
    rng = random.Random(5)
    first = [rng.randrange(2, 512) for _ in range(150)]

    def run(cache: bool):
        s = _scheduler(ckpt, spec_runner, enable_prefix_caching=cache, disable_radix_cache=not cache)
        log = {}

        def record(req, pos, drafts):
            log[(req.rid, pos)] = list(drafts)
            return drafts
        s.speculator.draft_override = record
        outs, cached = {}, {}
        s.add_request(_req("t1", first, n=40))
        while s.has_work():
            for o in s.step():
                outs[o.rid] = outs.get(o.rid, []) + o.new_token_ids
        s.add_request(_req("t2", first + outs["t1"] + [7, 8, 9], n=20))
        while s.has_work():
            for o in s.step():
                outs[o.rid] = outs.get(o.rid, []) + o.new_token_ids
                cached[o.rid] = o.cached_tokens
        if cache:
            s.prefix_caching.tree.reset()
        return outs, {key: d for key, d in log.items() if key[0] == "t2"}, cached.get("t2", 0)

    plain_outs, plain_drafts, _ = run(False)
    outs, drafts, cached = run(True)
    assert outs == plain_outs and cached >= 128
    assert len(drafts) > 5 and drafts == plain_drafts


def test_the_memory_planner_counts_both_modules_and_the_carried_rows(ckpt, spec_runner):
    from sglang.srt.planning.memory_planner import PlanSettings, kv_pool_bytes, weight_bytes

    a = spec_runner.server_args
    s = PlanSettings(weight_format="float32", model_dtype="float32", quant_numerics=a.quant_numerics,
                     kv_cache_dtype=a.kv_cache_dtype, dp_size=1, page_size=a.page_size,
                     context_length=a.context_length, max_running_requests=a.max_running_requests,
                     chunked_prefill_size=a.chunked_prefill_size, mem_fraction_static=0.8, max_total_tokens=None,
                     mtp_layers=spec_runner.num_mtp_layers, moe_backend=a.moe_backend)
    pool = spec_runner.kv_pool
    # the pool (both modules' caches, their rings and the carried rows) and the target's streams for them
    assert kv_pool_bytes(spec_runner.config, s, pool.num_slots - a.page_size) == \
        pool.nbytes() + spec_runner.model.streams_out.nbytes
    model = spec_runner.model
    held = sum(t.nbytes for t in list(model.parameters()) + list(model.buffers()))
    assert weight_bytes(spec_runner.config, "float32", "float32").total == held


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_chained_modules_replay_their_graphs_and_give_the_plain_outputs(ckpt):
    """On CUDA in fp32 with real breakable and decode graphs: both modules' passes and module
    1's draft steps replay graphs, and with the modules' own drafts and with partly accepted
    oracle drafts the greedy outputs are the plain run's."""
    gpu = dict(device="cuda", dtype="float32", enable_breakable_cuda_graph=True, breakable_cuda_graph_tokens=[16, 64])
    reqs = lambda: [_req(f"r{n}", p) for n, p in zip(LENGTHS, _prompts(LENGTHS))]  # noqa: E731
    plain = ModelRunner(cpu_server_args(model_path=ckpt, **dict(BASE, **gpu)))
    expect, _ = _serve(ckpt, plain, reqs(), **gpu)
    plain.shutdown()
    spec = ModelRunner(cpu_server_args(model_path=ckpt, **dict(BASE, **gpu, speculative_algorithm="mtp",
                                                               speculative_num_steps=3)))
    prompts = {tuple(p): f"r{n}" for n, p in zip(LENGTHS, _prompts(LENGTHS))}
    oracle = reference_drafts(lambda req: expect[prompts[tuple(req.origin_input_ids)]][0], lambda pos: pos % 3)
    for override in (oracle, None):
        got, stats = _serve(ckpt, spec, reqs(), override=override, **gpu)
        assert {rid: ids for rid, (ids, _) in got.items()} == {rid: ids for rid, (ids, _) in expect.items()}
        assert stats["mtp_breakable_replays"] > 0 and stats["mtp1_breakable_replays"] > 0
        assert stats["mtp1_decode_graph_replays"] > 0 and stats["spec_draft_tokens"] > 0
    spec.shutdown()
