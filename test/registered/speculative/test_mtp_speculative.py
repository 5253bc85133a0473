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
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.test.runner_args import cpu_server_args

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")
CKPT = str(Path(os.environ.get("DSV4_REFERENCE_DIR") or Path(__file__).parents[2] / "data" / "dsv4-reference")
           / "conformance-tiny")
BASE = dict(model_path=CKPT, context_length=512, max_total_tokens=4096, page_size=128, max_running_requests=8,
            chunked_prefill_size=64, disable_overlap_schedule=True)


def _runner(**kw):
    return ModelRunner(cpu_server_args(**BASE, **kw))


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
    args = dict(BASE, max_running_requests=runner.server_args.max_running_requests, **kw)
    if runner.num_mtp_layers:
        args.update(speculative_algorithm="mtp", speculative_num_steps=runner.server_args.speculative_num_steps)
    s = Scheduler(ServerArgs(**args).resolve(cuda_available=False), runner)
    if override is not None:
        s.speculator.draft_override = override
    free = s.pool.num_free_pages
    for r in reqs:
        s.add_request(r)
    res = {}
    while s.has_work():
        for o in s.step():
            ids, lps = res.get(o.rid, ([], []))
            res[o.rid] = (ids + o.new_token_ids, lps + (o.new_logprobs or []))
    assert s.pool.num_free_pages == free and s.pool.slots.num_free == s.pool.slots.capacity
    return res, s.get_stats()


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
    """Drafts equal to the target's greedy continuation; with wrong_at, the draft at that
    offset (and so every later one) is replaced by another token."""
    prompts = {tuple(p): f"r{n}" for n, p in zip(LENGTHS, _prompts(LENGTHS))}

    def override(req, first_pos, drafts):
        out = expected[prompts[tuple(req.origin_input_ids)]][0]
        start = first_pos - len(req.origin_input_ids)  # output index of the first draft
        d = list(out[start:start + len(drafts)])
        d += [2] * (len(drafts) - len(d))
        if wrong_at is not None and wrong_at(first_pos) < len(d):
            m = wrong_at(first_pos)
            d[m] = (d[m] + 1) % 510 + 2
        return d
    return override


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


@pytest.mark.parametrize("offset", [0, 1, 2])
def test_partly_accepted_drafts_roll_back_every_ring(spec_runner, expected, offset):
    """The draft at `offset` of every step is wrong (and, varying with the position, at
    other offsets too), so the spans rejected start at every position mod 4 and mod 8."""
    wrong = (lambda pos: offset) if offset < 2 else (lambda pos: pos % 3)
    reqs = [_req(f"r{n}", p) for n, p in zip(LENGTHS, _prompts(LENGTHS))]
    got, stats = _serve(spec_runner, reqs, override=_oracle(expected, wrong))
    _same(got, expected)
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"] or offset == 0


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
    with pytest.raises(ValueError, match="prefix caching|--enable-prefix-caching"):
        ServerArgs(model_path=CKPT, speculative_algorithm="mtp", enable_prefix_caching=True)
    with pytest.raises(ValueError, match=r"\[1, 4\]"):
        ServerArgs(model_path=CKPT, speculative_algorithm="mtp", speculative_num_steps=5)
    with pytest.raises(ValueError, match="needs --speculative-algorithm"):
        ServerArgs(model_path=CKPT, speculative_num_steps=2)
    assert ServerArgs(model_path=CKPT, speculative_algorithm="mtp").resolve(
        cuda_available=False).disable_overlap_schedule
