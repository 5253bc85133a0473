"""MTP speculative decoding on DeepSeek's conformance checkpoint (CPU, fp32: 4 layers of compress
ratios 0, 4, 128, 4, window 8, and its MTP layer).

Greedy outputs and their logprobs with speculation are the outputs without it, whatever the
drafts: the MTP layer's own (random weights: mostly rejected), drafts equal to the target's
greedy tokens (all accepted), and drafts wrong at a chosen offset (partly accepted). Prompt
lengths put the rejected spans across ratio-4 blocks, the window and the first ratio-128
block, so a wrong rollback of any ring shows up in later tokens."""

import os
import random
from pathlib import Path

import pytest
import torch

from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.model_executor.graph_dispatch import PathKind
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.test.kv_accounting import assert_no_request_holds_kv
from sglang.test.runner_args import cpu_server_args
from sglang.test.scheduler_runs import serve_all
from sglang.test.speculative_drafts import reference_drafts

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")
CKPT = str(Path(os.environ.get("DSV4_REFERENCE_DIR") or Path(__file__).parents[2] / "data" / "dsv4-reference")
           / "conformance-tiny")
BASE = dict(model_path=CKPT, context_length=512, max_total_tokens=4096, page_size=128, max_running_requests=64,
            chunked_prefill_size=64, disable_overlap_schedule=True)


def _runner(**kw):
    return ModelRunner(cpu_server_args(**dict(BASE, **kw)))


@pytest.fixture(scope="module")
def plain_runner():
    return _runner()


@pytest.fixture(scope="module")
def spec_runner():
    return _runner(speculative_algorithm="mtp", speculative_num_steps=3)


def _req(rid, ids, n=24, **params):
    params = dict(dict(max_new_tokens=n, temperature=0.0, ignore_eos=True), **params)
    return GenerateReqInput(rid=rid, input_ids=list(ids), return_logprob=True, sampling_params=SamplingParams(**params))


def _serve(runner, reqs, override=None, **kw):
    args = dict(BASE, max_running_requests=runner.server_args.max_running_requests)
    args.update(kw)
    if runner.num_mtp_layers:
        args.update(speculative_algorithm="mtp", speculative_num_steps=runner.server_args.speculative_num_steps)
    return serve_all(Scheduler(ServerArgs(**args).resolve(cuda_available=False), runner), reqs, override)


def _prompts(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(2, 512) for _ in range(n)] for n in lengths]


LENGTHS = [5, 8, 9, 30, 63, 64, 121, 125, 126, 127, 130, 200]


def _same(got, expect):
    assert set(got) == set(expect)
    for rid in expect:
        assert got[rid][0] == expect[rid][0], rid
        torch.testing.assert_close(torch.tensor(got[rid][1]), torch.tensor(expect[rid][1]), atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def expected(plain_runner):
    reqs = [_req(f"r{n}", p) for n, p in zip(LENGTHS, _prompts(LENGTHS))]
    return _serve(plain_runner, reqs)[0]


def _oracle(expected, wrong_at=None):
    """Drafts from the plain greedy outputs (speculative_drafts.reference_drafts)."""
    prompts = {tuple(p): f"r{n}" for n, p in zip(LENGTHS, _prompts(LENGTHS))}
    return reference_drafts(lambda req: expected[prompts[tuple(req.origin_input_ids)]][0], wrong_at)


def test_mtp_drafts_give_the_plain_greedy_outputs(spec_runner, expected):
    reqs = [_req(f"r{n}", p) for n, p in zip(LENGTHS, _prompts(LENGTHS))]
    got, stats = _serve(spec_runner, reqs)
    _same(got, expected)
    assert stats["spec_draft_tokens"] > 0 and stats["forward_mtp"] > 0


def test_drafts_the_target_agrees_with_are_all_accepted(spec_runner, expected):
    reqs = [_req(f"r{n}", p) for n, p in zip(LENGTHS, _prompts(LENGTHS))]
    got, stats = _serve(spec_runner, reqs, override=_oracle(expected))
    _same(got, expected)
    assert stats["spec_accept_rate"] == 1.0
    # 24 tokens: the first from the prefill, then steps of up to 4 (3 drafts + 1)
    assert stats["spec_mean_accepted_per_row"] > 2.5


def test_verify_rows_feed_the_drafts_from_the_device(spec_runner, expected, monkeypatch):
    """Without an override the host builds verify rows with placeholders and the drafts are
    written into the batch on the device from their slot's row (the host reads their values
    only to judge them). Drafts proposed on the device equal to the plain continuation are
    then all accepted, which they are only if the verify fed exactly them."""
    from sglang.srt.speculative.mtp import MTPSpeculator

    prompts = {tuple(p): f"r{n}" for n, p in zip(LENGTHS, _prompts(LENGTHS))}
    pass_ = {"reqs": None, "step": 0}  # the k draft steps of one drafting pass get the same request list

    def oracle_tokens(self, sched, reqs, logits, probs):
        if pass_["reqs"] is reqs:
            pass_["step"] += 1
        else:
            pass_.update(reqs=reqs, step=0)
        step = pass_["step"]
        toks = []
        for r in reqs:
            seq = r.origin_input_ids + expected[prompts[tuple(r.origin_input_ids)]][0]
            pos = r.prefix_len + 1 + step  # draft s predicts position prefix_len + 1 + s
            toks.append(seq[pos] if pos < len(seq) else 2)
        return torch.tensor(toks, dtype=torch.int64, device=logits.device)

    monkeypatch.setattr(MTPSpeculator, "_draft_tokens", oracle_tokens)
    got, stats = _serve(spec_runner, [_req(f"r{n}", p) for n, p in zip(LENGTHS, _prompts(LENGTHS))])
    _same(got, expected)
    assert stats["spec_accept_rate"] == 1.0 and stats["spec_mean_accepted_per_row"] > 2.5


@pytest.mark.parametrize("offset", [0, 1, 2])
def test_partly_accepted_drafts_roll_back_every_ring(spec_runner, expected, offset):
    """The draft at `offset` of every step is wrong (and, varying with the position, at
    other offsets too), so the spans rejected start at every position mod 4 and mod 8."""
    wrong = (lambda pos: offset) if offset < 2 else (lambda pos: pos % 3)
    reqs = [_req(f"r{n}", p) for n, p in zip(LENGTHS, _prompts(LENGTHS))]
    got, stats = _serve(spec_runner, reqs, override=_oracle(expected, wrong))
    _same(got, expected)
    if offset == 0:
        assert stats["spec_accepted_tokens"] == 0 < stats["spec_draft_tokens"]
    else:
        assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]


def test_rejected_drafts_leave_the_rings_as_a_plain_step_would(plain_runner, spec_runner):
    """After a verify whose drafts were all rejected, the request's window ring, compressor
    and indexer rings equal those of the same request served without speculation."""
    prompt = _prompts([126], seed=5)[0]  # the drafts' positions 127..129 cross a ratio-4 block and 128
    pools = {}
    for name, runner, override in (("plain", plain_runner, None),
                                   ("spec", spec_runner, lambda req, pos, d: [(t + 7) % 510 + 2 for t in d])):
        args = dict(BASE, max_running_requests=runner.server_args.max_running_requests)
        if runner.num_mtp_layers:
            args.update(speculative_algorithm="mtp", speculative_num_steps=3)
        s = Scheduler(ServerArgs(**args).resolve(cuda_available=False), runner)
        if override is not None:
            s.speculator.draft_override = override
        s.add_request(_req("x", prompt, n=8))
        while s.running == [] or len(s.running[0].output_ids) < 3:
            s.step()
        req = s.running[0]
        pool, slot = runner.kv_pool, req.req_pool_idx
        W = pool.window
        rows = {f"raw{i}": pool.raw[i][slot * W:(slot + 1) * W].clone() for i in range(4)}
        for i, st in pool.compressor_state.items():
            if i < 4:
                rows[f"c{i}"] = torch.cat([st.kv[slot], st.score[slot]]).clone()
        for i, st in pool.indexer_state.items():
            rows[f"i{i}"] = torch.cat([st.kv[slot], st.score[slot]]).clone()
        pools[name] = (req.prefix_len, rows)
        for r in list(s._live):
            s.abort_request(r)
        s.step()
    assert pools["plain"][0] == pools["spec"][0]
    for key, t in pools["plain"][1].items():
        torch.testing.assert_close(pools["spec"][1][key], t, atol=1e-5, rtol=0, msg=key)


def test_speculation_needs_mtp_layers_and_refuses_combinations():
    with pytest.raises(ValueError, match="has none"):
        ServerArgs(model_path="dsv4-tiny", speculative_algorithm="mtp").resolve(cuda_available=False)
    with pytest.raises(ValueError, match=r"\[1, 4\]"):
        ServerArgs(model_path=CKPT, speculative_algorithm="mtp", speculative_num_steps=5)
    with pytest.raises(ValueError, match="needs --speculative-algorithm"):
        ServerArgs(model_path=CKPT, speculative_num_steps=2)
    assert ServerArgs(model_path=CKPT, speculative_algorithm="mtp").resolve(
        cuda_available=False).disable_overlap_schedule


def test_first_drafts_are_the_mtp_layer_over_the_committed_sequence(spec_runner):
    """Every step's first draft is what the MTP layer predicts when run once over the whole
    committed sequence (target streams and next tokens): the tentative positions of earlier
    draft steps and rejected verify positions left nothing behind in its window ring."""
    prompt = _prompts([70], seed=9)[0]
    args = dict(BASE, max_running_requests=8, speculative_algorithm="mtp", speculative_num_steps=3)
    s = Scheduler(ServerArgs(**args).resolve(cuda_available=False), spec_runner)
    s.add_request(_req("x", prompt, n=40))
    seen, req = [], None  # (committed length, first draft)
    while s.has_work():
        s.step()
        for r in s.running:
            req = r
            seen.append((r.prefix_len, r.spec_drafts[0]))
    tokens = prompt + req.output_ids
    assert len(seen) > 5
    # the reference: target and MTP layer over the committed tokens, chunk by chunk, in a fresh slot
    runner, pool = spec_runner, spec_runner.req_to_token_pool
    slot = pool.alloc_req()
    n = max(L for L, _ in seen) + 1
    pool.ensure_capacity(slot, n)
    from sglang.srt.model_executor.forward_batch_info import ForwardMode, build_forward_batch
    preds = []
    for a in range(0, n - 1, 64):
        b = min(a + 64, n - 1)
        fb = build_forward_batch(ForwardMode.EXTEND, [slot], [a], [tokens[a:b]], "cpu")
        runner.forward_hidden(fb)
        streams = runner.model.streams_out[:b - a].clone()
        mfb = build_forward_batch(ForwardMode.EXTEND, [slot], [a], [tokens[a + 1:b + 1]], "cpu")
        _, final = runner.forward_mtp(mfb, streams)
        preds += runner.model.compute_logits(final).argmax(-1).tolist()
    pool.free_req(slot)
    for L, d in seen:
        assert d == preds[L - 1], L  # the MTP layer at position L - 1 predicts token L + 1


def test_stop_tokens_and_max_tokens_cut_accepted_drafts(spec_runner, plain_runner, expected):
    """No token past a stop token or max_new_tokens is returned, though the drafts after
    it were accepted in the same step."""
    p = _prompts(LENGTHS)[5]
    out = expected[f"r{LENGTHS[5]}"][0]
    stop = out[9]
    first = out.index(stop)
    reqs = lambda: [_req("stop", p, stop_token_ids=[stop]), _req("len", p, n=7)]  # noqa: E731
    got, _ = _serve(spec_runner, reqs(), override=_oracle(expected))  # the same prompt: the same greedy tokens
    plain, _ = _serve(plain_runner, reqs())
    _same(got, plain)
    assert got["stop"][0] == out[:first + 1] and got["len"][0] == out[:7]


def test_an_abort_between_speculative_steps_frees_everything(spec_runner, expected):
    args = dict(BASE, max_running_requests=64, speculative_algorithm="mtp", speculative_num_steps=3)
    s = Scheduler(ServerArgs(**args).resolve(cuda_available=False), spec_runner)
    s.speculator.draft_override = _oracle(expected, lambda pos: pos % 3)
    for n, p in zip(LENGTHS[:3], _prompts(LENGTHS)[:3]):
        s.add_request(_req(f"r{n}", p))
    got = {}
    while not (s.running and len(s.running[0].output_ids) >= 5):
        for o in s.step():
            got[o.rid] = got.get(o.rid, []) + o.new_token_ids
    victim = s.running[0].rid
    assert s.running[0].spec_drafts  # it holds drafts and speculative pages
    assert s.abort_request(victim)
    while s.has_work():
        for o in s.step():
            got[o.rid] = got.get(o.rid, []) + o.new_token_ids
    assert_no_request_holds_kv(s)
    for rid, ids in got.items():
        if rid != victim:
            assert ids == expected[rid][0]


def test_mixed_chunks_and_retraction_keep_the_outputs(spec_runner, plain_runner):
    """Verify rows share a forward with a prefill chunk (--enable-mixed-chunk), and a KV pool
    too small for every request retracts some mid-decode (their drafts are dropped and drafted
    again after the re-prefill): the outputs are the plain ones under the same settings."""
    lengths = [100, 120, 130, 90, 60, 110]
    reqs = lambda: [_req(f"m{n}", p, n=30) for n, p in zip(lengths, _prompts(lengths, seed=3))]  # noqa: E731
    expect, _ = _serve(plain_runner, reqs(), enable_mixed_chunk=True)
    got, stats = _serve(spec_runner, reqs(), enable_mixed_chunk=True)
    _same(got, expect)
    assert stats["num_forwards_mixed"] > 0 and stats["spec_draft_tokens"] > 0
    small = dict(max_total_tokens=768)  # six pages for six requests of up to two pages each
    expect, plain_stats = _serve(_runner(**small), reqs(), **small)
    got, stats = _serve(_runner(**small, speculative_algorithm="mtp", speculative_num_steps=3), reqs(), **small)
    _same(got, expect)
    assert stats["num_retracted_reqs"] > 0 and plain_stats["num_retracted_reqs"] > 0


def test_verify_steps_replay_from_breakable_graphs_with_the_eager_outputs(expected):
    torch.manual_seed(0)
    graphs = _runner(speculative_algorithm="mtp", speculative_num_steps=2, enable_breakable_cuda_graph=True,
                     breakable_cuda_graph_tokens=[16, 64], cuda_graph_max_bs=8)
    runner = graphs
    reqs = [_req(f"r{n}", p) for n, p in zip(LENGTHS, _prompts(LENGTHS))]
    before = runner.get_stats()["breakable_replays"]
    got, stats = _serve(runner, reqs, override=_oracle(expected, lambda pos: pos % 3))
    _same(got, expected)
    assert stats["breakable_replays"] > before


PROMPTS64 = _prompts([random.Random(64).randrange(1, 420) for _ in range(64)], seed=64)


@pytest.fixture(scope="module")
def expected64(plain_runner):
    return _serve(plain_runner, [_req(f"p{i}", p, n=16) for i, p in enumerate(PROMPTS64)])[0]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_64_prompts_of_mixed_lengths_give_the_plain_outputs_at_every_k(k, expected64):
    """64 prompts of 1 to 419 tokens, served together (chunked prefill, mixed verify batches),
    with drafts wrong at a pseudo-random offset of each position (or none): the greedy outputs
    and logprobs are the plain ones at k = 1, 2 and 3."""
    prompts = {tuple(p): f"p{i}" for i, p in enumerate(PROMPTS64)}
    override = reference_drafts(lambda req: expected64[prompts[tuple(req.origin_input_ids)]][0],
                                lambda pos: random.Random(pos).randrange(k + 1))  # k: none wrong
    runner = _runner(speculative_algorithm="mtp", speculative_num_steps=k)
    got, stats = _serve(runner, [_req(f"p{i}", p, n=16) for i, p in enumerate(PROMPTS64)], override=override)
    _same(got, expected64)
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]


def test_mtp_forwards_replay_from_their_own_graphs_with_the_eager_drafts(spec_runner, expected):
    """With graphs (the CPU emulator's decode graphs, breakable graphs), the MTP layer's
    draft steps replay decode graphs and its pass over the committed positions replays
    breakable graphs, at the target's buckets; drafts, and so acceptance, equal the eager
    MTP layer's, and the outputs stay the plain ones."""
    graphs = ModelRunner(cpu_server_args(**dict(BASE, speculative_algorithm="mtp", speculative_num_steps=3,
                                                enable_breakable_cuda_graph=True, breakable_cuda_graph_tokens=[16, 64],
                                                cuda_graph_max_bs=8)), cuda_graph_on_cpu=True)
    assert graphs.mtp_graph_runners[(0, PathKind.BREAKABLE)].buckets == [16, 64]
    assert graphs.mtp_graph_runners[(0, PathKind.DECODE_GRAPH)].buckets == [1, 2, 4, 8]
    reqs = lambda: [_req(f"r{n}", p) for n, p in zip(LENGTHS, _prompts(LENGTHS))]  # noqa: E731
    oracle = _oracle(expected, lambda pos: pos % 3)

    def recording(log):
        def override(req, pos, drafts):
            log[(req.rid, pos)] = list(drafts)
            return oracle(req, pos, drafts)
        return override

    eager_drafts, graph_drafts = {}, {}
    eager, _ = _serve(spec_runner, reqs(), override=recording(eager_drafts), max_running_requests=8)
    got, stats = _serve(graphs, reqs(), override=recording(graph_drafts), max_running_requests=8)
    _same(got, expected)
    _same(eager, expected)
    assert len(graph_drafts) > 50 and graph_drafts == eager_drafts
    # the memory planner counts the graphs' copies of the streams (and the pool's rings)
    from sglang.srt.planning.memory_planner import raw_window_plan_bytes

    a = graphs.server_args
    plan = _plan_settings(graphs, breakable_max_tokens=64, decode_graph_max_bs=8)
    assert raw_window_plan_bytes(graphs.config, plan) == sum(t.nbytes for t in graphs.kv_pool.raw) + \
        graphs.model.streams_out.nbytes + sum(r.streams_in.nbytes for r in graphs.mtp_graph_runners.values())
    assert a.breakable_cuda_graph_tokens[-1] == 64 and a.cuda_graph_max_bs == 8
    assert stats["mtp_decode_graph_replays"] > 0 and stats["mtp_breakable_replays"] > 0
    # a pass of 1-5 tokens pads to 16 more than twice over: those run eagerly, nothing else does
    assert set(stats["mtp_breakable_fallbacks"]) <= {"padding_waste"}
    graphs.shutdown()


def _exact_first_pairs(runner, prompt, params):
    """The target's exact joint distribution of the first two sampled tokens {(t0, t1): P}."""
    from sglang.srt.layers.sampler import sampling_probs
    from sglang.srt.model_executor.forward_batch_info import ForwardMode, build_forward_batch

    def next_probs(ids):
        pool = runner.req_to_token_pool
        slot = pool.alloc_req()
        pool.ensure_capacity(slot, len(ids))
        fb = build_forward_batch(ForwardMode.EXTEND, [slot], [0], [ids], "cpu")
        probs = sampling_probs(runner.forward(fb).next_token_logits, [params])[0]
        pool.free_req(slot)
        return probs

    p0 = next_probs(prompt)
    return {(t0, t1): (p0[t0] * p1[t1]).item() for t0 in p0.nonzero().flatten().tolist()
            for p1 in [next_probs(prompt + [t0])] for t1 in p1.nonzero().flatten().tolist()}


def test_sampled_outputs_follow_the_target_distribution():
    """At temperature 1 (top-k 4) the empirical joint distribution of the first two output
    tokens over 800 seeded requests (the second is what a speculative step produces: an
    accepted draft or a draw from the residual) is the target's exact one. The draft comes
    from a known distribution q (the target's possible second tokens, the likeliest with more
    mass than the target gives it), so both branches of the rule run often."""
    big = dict(chunked_prefill_size=2048)  # the whole wave prefills in a few steps
    prompt = _prompts([40], seed=11)[0]
    params = dict(temperature=1.0, top_k=4)
    runner = _runner(**big, speculative_algorithm="mtp", speculative_num_steps=2)
    exact = _exact_first_pairs(runner, prompt, SamplingParams(max_new_tokens=3, **params))
    seconds = {}
    for (_, t1), p in exact.items():
        seconds[t1] = seconds.get(t1, 0.0) + p
    q = torch.zeros(1, 512)
    q[0, list(seconds)] = 0.4 / (len(seconds) - 1)
    q[0, max(seconds, key=seconds.get)] = 0.6
    rng = torch.Generator().manual_seed(0)

    def drafts_from_q(req, pos, drafts):
        req.spec_draft_probs = q
        return [int(torch.multinomial(q[0], 1, generator=rng))]

    reqs = [_req(f"s{i}", prompt, n=3, seed=i, **params) for i in range(800)]
    got, stats = _serve(runner, reqs, override=drafts_from_q, **big)
    assert 0.1 < stats["spec_accept_rate"] < 0.9, stats["spec_accept_rate"]  # both branches of the rule ran
    counts = {}
    for ids, _ in got.values():
        counts[tuple(ids[:2])] = counts.get(tuple(ids[:2]), 0) + 1
    assert set(counts) <= set(exact)
    tv = 0.5 * sum(abs(counts.get(k, 0) / len(got) - p) for k, p in exact.items())
    print(f"total variation {tv:.3f} from the exact distribution over {len(exact)} token pairs")
    assert tv < 0.1  # 800 draws: sampling noise alone is about 0.07 here


def test_the_acceptance_rule_draws_from_the_target_distribution():
    """The rule alone, 8000 times over a six-token vocabulary: a draft drawn from q, kept with
    probability min(1, p/q), else replaced by a draw from max(0, p - q): the first token
    follows p exactly (whatever q), and the bonus after an accepted draft is drawn from the
    next row's p."""
    from types import SimpleNamespace

    from sglang.srt.layers.sampler import Sampler
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.speculative.mtp import MTPSpeculator

    p_logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -9.0], [0.0, 0.0, 3.0, 0.0, 0.0, 0.0]])
    p = torch.softmax(p_logits[0], -1)
    q = torch.tensor([[0.05, 0.05, 0.1, 0.5, 0.1, 0.2]])  # mass where p has little
    params = SamplingParams(max_new_tokens=4, temperature=1.0)
    sched = SimpleNamespace(sampler=Sampler(seed=0))
    req = Req(rid="r", origin_input_ids=[1], sampling_params=params, generator=torch.Generator().manual_seed(1))
    req.spec_draft_probs = q
    rng = torch.Generator().manual_seed(2)
    spec = object.__new__(MTPSpeculator)
    n, first, bonus = 8000, torch.zeros(6), torch.zeros(6)
    for _ in range(n):
        d = int(torch.multinomial(q[0], 1, generator=rng))
        out = spec._accept_sampled(sched, req, [d], p_logits, [0, 1])
        first[out[0]] += 1
        if len(out) == 2:
            bonus[out[1]] += 1
    tv = 0.5 * (first / n - p).abs().sum().item()
    accepted = bonus.sum().item() / n
    expect_accepted = torch.minimum(p, q[0]).sum().item()
    print(f"first token: total variation {tv:.4f}; accepted {accepted:.3f} (expected {expect_accepted:.3f})")
    assert tv < 0.02 and abs(accepted - expect_accepted) < 0.02
    assert 0.5 * (bonus / bonus.sum() - torch.softmax(p_logits[1], -1)).abs().sum().item() < 0.04


def test_prefix_caching_with_speculation_gives_the_plain_outputs(spec_runner, plain_runner):
    """Shared prefixes and a second chat turn over the first turn's answer (a state taken in
    a speculative decode step: drafts stop at page boundaries so one lands there), with the
    MTP layer's own drafts and partly accepted ones: the outputs of plain decoding without a
    cache, and the second turn resumes from the first turn's pages."""
    rng = random.Random(4)
    base = [rng.randrange(2, 512) for _ in range(260)]
    # answers of 60 tokens: those of the prompts past 200 cross position 256 while decoding
    firsts = lambda: [_req(f"a{s}", base[:s] + [rng2.randrange(2, 512) for _ in range(30)], n=60)  # noqa: E731
                      for s, rng2 in ((s, random.Random(s)) for s in (127, 128, 200, 220, 256))]
    plain, _ = _serve(plain_runner, firsts(), disable_radix_cache=True)
    turns = lambda out: [_req(f"t{r.rid}", r.input_ids + out[r.rid][0] + [7, 8, 9], n=12)  # noqa: E731
                         for r in firsts()]
    plain.update(_serve(plain_runner, turns(plain), disable_radix_cache=True)[0])
    prompts = {tuple(r.input_ids): r.rid for r in firsts() + turns(plain)}

    wrong_at_pos_mod_3 = reference_drafts(lambda req: plain[prompts[tuple(req.origin_input_ids)]][0],
                                          lambda pos: pos % 3)

    for override in (None, wrong_at_pos_mod_3):
        args = dict(BASE, max_running_requests=64, speculative_algorithm="mtp", speculative_num_steps=3,
                    enable_prefix_caching=True)
        s = Scheduler(ServerArgs(**args).resolve(cuda_available=False), spec_runner)
        s.speculator.draft_override = override
        got, cached = {}, {}
        for wave in (firsts(), None):
            for r in wave if wave is not None else turns(plain):
                s.add_request(r)
            while s.has_work():
                for o in s.step():
                    ids, lps = got.get(o.rid, ([], []))
                    got[o.rid] = (ids + o.new_token_ids, lps + (o.new_logprobs or []))
                    cached[o.rid] = o.cached_tokens
        _same(got, plain)
        # each turn resumes at least from the first turn's last page boundary before its answer ends
        for r in firsts():
            assert cached[f"t{r.rid}"] >= (len(r.input_ids) + 59) // 128 * 128 > 0, (r.rid, cached[f"t{r.rid}"])
        assert s.get_stats()["spec_draft_tokens"] > 0
        s.prefix_caching.tree.reset()


def test_a_simulated_accept_length_keeps_that_many_drafts_on_average(monkeypatch):
    """Benchmarks pin the accepted length (random weights accept almost nothing): each verify
    row keeps floor(x + u) drafts, so the mean per row is x."""
    from sglang.srt.speculative import mtp

    monkeypatch.setenv(mtp.SIMULATE_ENV, "1.5")
    runner = _runner(speculative_algorithm="mtp", speculative_num_steps=3)
    reqs = [_req(f"r{n}", p, n=40) for n, p in zip(LENGTHS, _prompts(LENGTHS))]
    _, stats = _serve(runner, reqs)
    assert stats["spec_mean_accepted_per_row"] == pytest.approx(1.5, abs=0.15)
    monkeypatch.setenv(mtp.SIMULATE_ENV, "4")
    with pytest.raises(ValueError, match=r"\[0, 3\]"):
        mtp.MTPSpeculator(runner, 3)


def _plan_settings(runner, **graphs):
    from sglang.srt.planning.memory_planner import PlanSettings

    a = runner.server_args
    return PlanSettings(weight_format="float32", model_dtype="float32", quant_numerics=a.quant_numerics,
                        kv_cache_dtype=a.kv_cache_dtype, dp_size=1, page_size=a.page_size,
                        context_length=a.context_length, max_running_requests=a.max_running_requests,
                        chunked_prefill_size=a.chunked_prefill_size, mem_fraction_static=0.8, max_total_tokens=None,
                        mtp_layers=runner.num_mtp_layers, moe_backend=a.moe_backend, **graphs)


def test_the_memory_planner_counts_the_mtp_layers_rings_and_streams(spec_runner):
    import dataclasses

    from sglang.srt.planning.memory_planner import raw_window_plan_bytes

    s = _plan_settings(spec_runner)
    pool = spec_runner.kv_pool
    assert len(pool.raw) == spec_runner.config.num_hidden_layers + 1
    built = sum(t.nbytes for t in pool.raw) + spec_runner.model.streams_out.nbytes
    assert raw_window_plan_bytes(spec_runner.config, s) == built
    assert raw_window_plan_bytes(spec_runner.config, dataclasses.replace(s, mtp_layers=0)) == \
        sum(t.nbytes for t in pool.raw[:-1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_verify_replayed_from_breakable_graphs_gives_the_plain_outputs(dtype):
    """On CUDA with real breakable graphs: drafts wrong at varying offsets (partial
    acceptance) and the MTP layer's own drafts give the plain run's greedy tokens. In fp32
    exactly; in bf16 a verify row computes its positions in other batch shapes than decode
    rows do, so the tokens may part where the plain run's top two were a near tie: a logprob
    gap under 0.3, the spread of one request's bf16 logits across batch shapes measured on an
    H200 (test/registered/models/test_dsv4_gpu.py); every divergence must be at such a position."""
    gpu = dict(device="cuda", dtype=dtype, enable_breakable_cuda_graph=True, breakable_cuda_graph_tokens=[16, 64])
    lengths = LENGTHS
    reqs = lambda: [GenerateReqInput(rid=f"r{n}", input_ids=p, return_logprob=True, top_logprobs_num=2,  # noqa: E731
                                     sampling_params=SamplingParams(max_new_tokens=32, temperature=0.0,
                                                                    ignore_eos=True))
                    for n, p in zip(lengths, _prompts(lengths))]

    def serve(runner, override=None):
        args = dict(BASE, **gpu)
        if runner.num_mtp_layers:
            args.update(speculative_algorithm="mtp", speculative_num_steps=3)
        s = Scheduler(ServerArgs(**args).resolve(cuda_available=True), runner)
        if override is not None:
            s.speculator.draft_override = override
        for r in reqs():
            s.add_request(r)
        res = {}
        while s.has_work():
            for o in s.step():
                ids, tops = res.get(o.rid, ([], []))
                res[o.rid] = (ids + o.new_token_ids, tops + o.new_top_logprobs)
        return res, s.get_stats()

    plain = ModelRunner(cpu_server_args(**dict(BASE, **gpu)))
    expect, _ = serve(plain)
    plain.shutdown()
    spec = ModelRunner(cpu_server_args(**dict(BASE, **gpu, speculative_algorithm="mtp", speculative_num_steps=3)))
    prompts = {tuple(p): f"r{n}" for n, p in zip(lengths, _prompts(lengths))}

    wrong_at_pos_mod_3 = reference_drafts(lambda req: expect[prompts[tuple(req.origin_input_ids)]][0],
                                          lambda pos: pos % 3)

    for override in (wrong_at_pos_mod_3, None):
        got, stats = serve(spec, override)
        assert set(got) == set(expect)
        parted = 0
        for rid, (ids, _) in expect.items():
            m = next((i for i, (a, b) in enumerate(zip(got[rid][0], ids)) if a != b), None)
            if m is None:
                assert len(got[rid][0]) == len(ids)
                continue
            assert dtype == "bfloat16", (rid, m)
            (lp1, _), (lp2, _) = expect[rid][1][m][:2]
            assert lp1 - lp2 < 0.3, (rid, m, lp1 - lp2)
            parted += 1
        assert stats["breakable_replays"] > 0 and stats["spec_draft_tokens"] > 0
        # the MTP layer's draft steps and its passes over accepted tokens replay their own graphs
        assert stats["mtp_decode_graph_replays"] > 0 and stats["mtp_breakable_replays"] > 0
        print(f"{dtype}: accept rate {stats['spec_accept_rate']:.2f}, {parted} of {len(expect)} requests part at a near tie")
    spec.shutdown()
