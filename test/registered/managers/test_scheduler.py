"""Scheduler policy on CPU with a fake runner (overlap scheduling and prefix caching on, the
defaults, except where a test counts tokens per step or chunk sizes): chunked prefill, mixed
chunk, alternation, admission caps, retraction and resume, abort, finish reasons, streaming, and
KV accounting.

The fake runner is a tiny "model" that really uses the KV cache: it writes each fed token at
the page table's slot for its position and derives the next token from the request's whole
cached sequence, read back through req_to_token. A wrong prefix length, page mapping or resume would change the
greedy output, so "equals the reference" checks the KV bookkeeping end to end.
"""

import random
from types import SimpleNamespace

import pytest
import torch

from sglang.srt.managers.io_struct import GenerateReqInput, output_text
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.mem_cache.req_to_token_pool import ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.test.kv_accounting import assert_no_request_holds_kv

VOCAB = 64
EOS = 1
EXTEND, DECODE, MIXED = ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED


def next_token_of(tokens):
    """The fake model: a hash of the whole sequence, never 0 (bos) or 1 (eos)."""
    h = sum((j + 1) * t for j, t in enumerate(tokens))
    return 2 + (h * 2654435761) % 1000003 % (VOCAB - 2)


def detok(ids):
    return "".join(chr(ord("a") + (t - 2) % 26) for t in ids if t >= 2)


def reference(prompt, max_new_tokens):
    toks, out = list(prompt), []
    for _ in range(max_new_tokens):
        out.append(next_token_of(toks))
        toks.append(out[-1])
    return out


class FakeModelRunner:
    """Same attributes as ModelRunner; records every ForwardBatch it runs."""

    def __init__(self, server_args, eos_token_id=EOS):
        self.config = SimpleNamespace(vocab_size=VOCAB, eos_token_id=eos_token_id)
        self.device = torch.device("cpu")
        self.max_num_reqs = server_args.max_running_requests
        self.max_context_len = server_args.context_length
        ps = server_args.page_size
        num_pages = server_args.max_total_tokens // ps + 1  # + the padding page
        self.req_to_token_pool = ReqToTokenPool(self.max_num_reqs, self.max_context_len, num_pages, ps, "cpu")
        self.kv_token = torch.full((num_pages * ps,), -1, dtype=torch.int64)
        self.kv_slot = torch.full((num_pages * ps,), -1, dtype=torch.int64)
        self.kv_pos = torch.full((num_pages * ps,), -1, dtype=torch.int64)
        # a prefix cache maps pages another request's slot wrote into a request's table
        self.shares_pages = server_args.enable_prefix_caching
        self.batches = []

    def forward(self, fb):
        self.batches.append(fb)
        rtt = self.req_to_token_pool.req_to_token
        write_loc = rtt[fb.token_req_slot, fb.positions].long()  # what the metadata builder derives
        self.kv_token[write_loc] = fb.input_ids
        self.kv_slot[write_loc] = fb.token_req_slot
        self.kv_pos[write_loc] = fb.positions
        logits = torch.zeros(fb.batch_size, VOCAB)
        req_slots = fb.token_req_slot[fb.last_token_indices()].tolist()
        for i, (slot, seq_len) in enumerate(zip(req_slots, fb.seq_lens_cpu)):
            locs = rtt[slot, :seq_len].long()
            assert (self.kv_pos[locs] == torch.arange(seq_len)).all(), "request reads KV of other positions"
            if not self.shares_pages:
                assert (self.kv_slot[locs] == slot).all(), "request reads KV it never wrote"
            logits[i, next_token_of(self.kv_token[locs].tolist())] = 5.0
        return SimpleNamespace(next_token_logits=logits)

    def get_stats(self):
        return {"fake_forwards": len(self.batches)}


# Tests of the policy without a prefix cache (on by default), whose exact chunk sizes, forward
# modes and retraction order count on every prompt being computed whole (a cache cuts chunks at
# page boundaries and starts a resumed request after its cached prefix).
NO_CACHE = dict(disable_radix_cache=True)


def create_scheduler(eos_token_id=EOS, decode_fn=detok, **overrides):
    kw = dict(model_path="dsv4-tiny", device="cpu", context_length=1024, max_total_tokens=8192,
              max_running_requests=16, chunked_prefill_size=256)
    kw.update(overrides)
    args = ServerArgs(**kw).resolve(cuda_available=False)
    return Scheduler(args, FakeModelRunner(args, eos_token_id), decode_fn=decode_fn)


def create_requests(num, prompt_len, max_new_tokens=8, seed=0, rid_prefix="r", stream=False, **params):
    rng = random.Random(seed)
    lens = prompt_len if isinstance(prompt_len, list) else [prompt_len] * num
    return [
        GenerateReqInput(
            rid=f"{rid_prefix}{i}",
            input_ids=[rng.randrange(2, VOCAB) for _ in range(lens[i])],
            sampling_params=SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, **params),
            stream=stream,
        )
        for i in range(num)
    ]


def assert_kv_accounting(s):
    """Between steps: holders map exactly ceil(prefix_len / page_size) pages and own one slot;
    every other page in use is the prefix cache's."""
    holders = s.running + ([s.chunked_req] if s.chunked_req else [])
    mapped = set()
    for r in holders:
        pages = s.pool.pages_of(r.req_pool_idx)
        assert len(pages) == len(set(pages)) == -(-r.prefix_len // s.page_size)
        mapped.update(pages)
    cached = set(s.prefix_caching.tree.held_pages()) if s.prefix_caching is not None else set()
    assert s.pool.pages.num_used == len(mapped | cached)
    assert s.pool.slots.num_used == len(holders)
    assert all(r.req_pool_idx is None and r.prefix_len == 0 for r in s.waiting)
    assert len(holders) <= s.max_running_requests


def assert_all_free(s):
    assert_no_request_holds_kv(s)
    assert not s.has_work()


def run(s, reqs=(), max_steps=5000):
    """Add reqs, step until idle; returns rid -> final state and checks accounting every step."""
    for r in reqs:
        s.add_request(r)
    results = {}
    for _ in range(max_steps):
        if not s.has_work():
            break
        collect(s.step(), results)
        assert_kv_accounting(s)
    assert_all_free(s)
    return results


def collect(outs, results):
    for o in outs:
        res = results.setdefault(o.rid, {"output_ids": [], "outs": []})
        res["output_ids"] += o.new_token_ids
        res["outs"].append(o)
        if o.finished:
            res.update(finish_reason=o.finish_reason, error=o.error, completion_tokens=o.completion_tokens,
                       prompt_tokens=o.prompt_tokens)


def modes(s):
    return [b.forward_mode for b in s.model_runner.batches]


# ---- chunked prefill ------------------------------------------------------------------


def test_long_prompt_is_prefilled_in_budget_sized_chunks():
    s = create_scheduler(**NO_CACHE, chunked_prefill_size=256)
    (req,) = create_requests(1, 700, max_new_tokens=4)
    res = run(s, [req])
    b = s.model_runner.batches
    assert modes(s) == [EXTEND, EXTEND, EXTEND, DECODE, DECODE, DECODE]
    assert [x.extend_seq_lens_cpu for x in b[:3]] == [[256], [256], [188]]
    assert [x.extend_prefix_lens_cpu for x in b[:3]] == [[0], [256], [512]]
    assert [x.seq_lens_cpu for x in b[:3]] == [[256], [512], [700]]
    assert b[1].positions.tolist() == list(range(256, 512))
    assert b[1].input_ids.tolist() == req.input_ids[256:512]
    assert b[3].positions.tolist() == [700] and b[3].seq_lens_cpu == [701]
    assert res["r0"]["output_ids"] == reference(req.input_ids, 4)
    assert res["r0"]["finish_reason"] == {"type": "length", "length": 4}


def test_short_prompts_share_an_extend_and_only_the_last_is_chunked():
    s = create_scheduler(chunked_prefill_size=256)
    reqs = create_requests(3, 100, max_new_tokens=3)
    res = run(s, reqs)
    b = s.model_runner.batches
    assert b[0].extend_seq_lens_cpu == [100, 100, 56]
    # prefill priority, but alternating with the two requests that are already decoding
    assert modes(s)[:3] == [EXTEND, DECODE, EXTEND]
    assert b[1].batch_size == 2
    assert b[2].extend_seq_lens_cpu == [44] and b[2].extend_prefix_lens_cpu == [56]
    for r in reqs:
        assert res[r.rid]["output_ids"] == reference(r.input_ids, 3)


def test_disabled_chunking_prefills_whole_prompts():
    s = create_scheduler(**NO_CACHE, chunked_prefill_size=-1)
    reqs = create_requests(2, [700, 300], max_new_tokens=2)
    res = run(s, reqs)
    assert s.model_runner.batches[0].extend_seq_lens_cpu == [700, 300]
    assert all(res[r.rid]["output_ids"] == reference(r.input_ids, 2) for r in reqs)


def test_no_step_carries_more_tokens_than_the_staging_rows_hold():
    """Without chunking a step holds whole prompts up to ServerArgs.max_step_tokens (the raw-KV
    staging rows: the context length here): a prompt that does not fit waits, unsplit."""
    s = create_scheduler(**NO_CACHE, chunked_prefill_size=-1)
    assert s.max_step_tokens == s.server_args.max_step_tokens == 1024
    reqs = create_requests(3, [700, 500, 300], max_new_tokens=2)
    res = run(s, reqs)
    prefills = [b.extend_seq_lens_cpu for b in s.model_runner.batches if b.forward_mode == EXTEND]
    assert prefills[:2] == [[700], [500, 300]]
    assert max(b.num_tokens for b in s.model_runner.batches) <= 1024
    assert all(res[r.rid]["output_ids"] == reference(r.input_ids, 2) for r in reqs)


# ---- mixed chunk and alternation --------------------------------------------------------


def _start_three_decoders(s):
    short = create_requests(3, 10, max_new_tokens=20, seed=1, rid_prefix="d")
    for r in short:
        s.add_request(r)
    results = {}
    collect(s.step(), results)  # one EXTEND prefills all three; each samples its first token
    (long_req,) = create_requests(1, 150, max_new_tokens=5, seed=2, rid_prefix="p")
    s.add_request(long_req)
    return short, long_req, results


def test_mixed_chunk_runs_prefill_rows_first_then_every_decode_row():
    # counts tokens per step: without overlap, so the host knows each step's tokens at its end
    s = create_scheduler(**NO_CACHE, chunked_prefill_size=64, enable_mixed_chunk=True, disable_overlap_schedule=True)
    short, long_req, results = _start_three_decoders(s)
    for _ in range(3):
        collect(s.step(), results)
        assert s.last_batch_mode == MIXED
    b = s.model_runner.batches
    # chunk budget 64 minus the 3 decode rows; the long prompt's rows come first
    assert [x.extend_seq_lens_cpu for x in b[1:4]] == [[61, 1, 1, 1], [61, 1, 1, 1], [28, 1, 1, 1]]
    assert [x.extend_prefix_lens_cpu for x in b[1:4]] == [[0, 10, 10, 10], [61, 11, 11, 11], [122, 12, 12, 12]]
    assert b[1].positions.tolist()[:3] == [0, 1, 2] and b[1].positions.tolist()[61:] == [10, 10, 10]
    assert all(x.forward_mode == MIXED for x in b[1:4])
    # decode rows got a token from every mixed step; the long prompt only from its final chunk
    assert [len(s._live[r.rid].output_ids) for r in short] == [4, 4, 4]
    assert len(s._live["p0"].output_ids) == 1
    res = run(s)
    collect([o for r in res.values() for o in r["outs"]], results)
    assert modes(s)[4] == DECODE and s.model_runner.batches[4].batch_size == 4
    for r in short + [long_req]:
        assert results[r.rid]["output_ids"] == reference(r.input_ids, r.sampling_params.max_new_tokens)


def test_without_mixed_chunk_prefill_and_decode_steps_alternate():
    s = create_scheduler(chunked_prefill_size=64, enable_mixed_chunk=False)
    short, long_req, results = _start_three_decoders(s)
    res = run(s)
    collect([o for r in res.values() for o in r["outs"]], results)
    b = s.model_runner.batches
    # the first step was an EXTEND, so decode goes next; then they take turns
    assert modes(s)[1:8] == [DECODE, EXTEND, DECODE, EXTEND, DECODE, EXTEND, DECODE]
    assert [b[i].extend_seq_lens_cpu for i in (2, 4, 6)] == [[64], [64], [22]]
    assert b[1].batch_size == 3 and b[7].batch_size == 4
    assert MIXED not in modes(s)
    for r in short + [long_req]:
        assert results[r.rid]["output_ids"] == reference(r.input_ids, r.sampling_params.max_new_tokens)


# ---- admission ------------------------------------------------------------------------


def test_max_running_requests_caps_requests_holding_kv():
    s = create_scheduler(max_running_requests=2)
    reqs = create_requests(5, 20, max_new_tokens=5)
    res = run(s, reqs)  # run() asserts <= 2 holders after every step
    assert s.model_runner.batches[0].batch_size == 2
    assert max(b.batch_size for b in s.model_runner.batches) == 2
    assert all(res[r.rid]["output_ids"] == reference(r.input_ids, 5) for r in reqs)


# ---- retraction -----------------------------------------------------------------------


@pytest.mark.parametrize("mixed", [False, True])
def test_retraction_frees_newest_and_resumes_with_identical_greedy_output(mixed):
    # 3 pages of 128 tokens; each request grows to 160 tokens (2 pages)
    s = create_scheduler(max_total_tokens=384, enable_mixed_chunk=mixed)
    reqs = create_requests(4, 100, max_new_tokens=60, ignore_eos=True)
    for r in reqs:
        s.add_request(r)
    results, retracted_seen = {}, False
    while s.has_work():
        collect(s.step(), results)
        assert_kv_accounting(s)  # retracted requests hold no page and no slot
        retracted_seen |= any(r.num_retractions for r in s.waiting)
    assert_all_free(s)
    assert retracted_seen and s.get_stats()["num_retracted_reqs"] >= 2
    for r in reqs:
        assert results[r.rid]["output_ids"] == reference(r.input_ids, 60)
        assert results[r.rid]["finish_reason"] == {"type": "length", "length": 60}


def test_oldest_request_is_never_retracted():
    s = create_scheduler(max_total_tokens=384)
    reqs = create_requests(3, 100, max_new_tokens=60, ignore_eos=True)
    for r in reqs:
        s.add_request(r)
    r0 = s.waiting[0]
    while s.has_work():
        s.step()
        assert r0.num_retractions == 0
    assert_all_free(s)


def test_request_that_can_never_fit_fails_with_error_and_frees_kv():
    s = create_scheduler(max_total_tokens=128)  # one page
    big, small = create_requests(2, [100, 10], max_new_tokens=60, ignore_eos=True)
    res = run(s, [big, small])
    assert res["r0"]["finish_reason"]["type"] == "abort"
    assert "more than the whole pool" in res["r0"]["error"]
    assert res["r0"]["output_ids"] == reference(big.input_ids, 29)  # fed positions 100..127
    assert res["r1"]["output_ids"] == reference(small.input_ids, 60)
    assert s.get_stats()["num_failed_reqs"] == 1


# ---- abort ----------------------------------------------------------------------------


def test_abort_frees_kv_at_once_and_leaves_others_unaffected():
    s = create_scheduler(**NO_CACHE, chunked_prefill_size=256)
    reqs = create_requests(3, [200, 200, 300], max_new_tokens=10)
    for r in reqs:
        s.add_request(r)
    results = {}
    collect(s.step(), results)  # r0 whole, r1 chunk of 56 (r2 waits)
    assert s.chunked_req.rid == "r1"
    free_before = s.pool.num_free_pages
    assert s.abort_request("r1") and s.abort_request("r2")  # chunked and waiting
    assert s.pool.num_free_pages == free_before + 1 and s.chunked_req is None and not s.waiting
    assert not s.abort_request("r1") and not s.abort_request("nope")
    res = run(s)
    collect([o for r in res.values() for o in r["outs"]], results)
    for rid in ("r1", "r2"):
        assert results[rid]["finish_reason"] == {"type": "abort", "message": "aborted by the client"}
        assert results[rid]["completion_tokens"] == 0
    assert results["r0"]["output_ids"] == reference(reqs[0].input_ids, 10)
    assert s.get_stats()["num_aborted_reqs"] == 2


def test_abort_of_a_running_request_returns_its_unsent_tokens():
    s = create_scheduler(disable_overlap_schedule=True)  # overlap: test_overlap_schedule.py
    (req,) = create_requests(1, 20, max_new_tokens=50)
    s.add_request(req)
    for _ in range(4):
        assert s.step() == []  # not streaming: nothing until it finishes
    assert s.abort_request("r0")
    assert s.pool.num_free_pages == s.pool.pages.capacity
    (out,) = s.step()
    assert out.finished and out.new_token_ids == reference(req.input_ids, 4)
    assert out.finish_reason["type"] == "abort"
    assert_all_free(s)


# ---- finish reasons -------------------------------------------------------------------


def test_stop_token_id_ends_the_request_and_is_reported():
    (probe,) = create_requests(1, 30, max_new_tokens=20)
    ref = reference(probe.input_ids, 20)
    stop = ref[5]
    first = ref.index(stop)
    probe.sampling_params.stop_token_ids = [stop]
    res = run(create_scheduler(), [probe])
    assert res["r0"]["output_ids"] == ref[: first + 1]
    assert res["r0"]["finish_reason"] == {"type": "stop", "matched": stop}


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_eos_stops_unless_ignore_eos(ignore_eos):
    (probe,) = create_requests(1, 30, max_new_tokens=20, ignore_eos=ignore_eos)
    ref = reference(probe.input_ids, 20)
    eos = ref[4]  # pretend the model's eos is a token this request generates
    res = run(create_scheduler(eos_token_id=[eos]), [probe])
    if ignore_eos:
        assert res["r0"]["output_ids"] == ref
        assert res["r0"]["finish_reason"] == {"type": "length", "length": 20}
    else:
        assert res["r0"]["output_ids"] == ref[: ref.index(eos) + 1]
        assert res["r0"]["finish_reason"] == {"type": "stop", "matched": eos}


def test_stop_string_ends_at_the_token_completing_it_and_is_trimmed_from_text():
    (probe,) = create_requests(1, 30, max_new_tokens=20)
    ref = reference(probe.input_ids, 20)
    text = detok(ref)
    stop = text[6:9]
    end = next(i for i in range(20) if stop in detok(ref[: i + 1]))
    probe.sampling_params.stop = [stop]
    res = run(create_scheduler(), [probe])
    out = res["r0"]["output_ids"]
    assert out == ref[: end + 1]
    assert res["r0"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert output_text(detok, out, res["r0"]["finish_reason"]) == text[: text.index(stop)]


def test_max_new_tokens_zero_finishes_after_prefill_with_no_tokens():
    s = create_scheduler(chunked_prefill_size=64)
    (req,) = create_requests(1, 100, max_new_tokens=0)
    res = run(s, [req])
    assert modes(s) == [EXTEND, EXTEND]
    assert res["r0"]["output_ids"] == [] and res["r0"]["completion_tokens"] == 0
    assert res["r0"]["finish_reason"] == {"type": "length", "length": 0}


def test_generation_stops_at_the_context_length():
    s = create_scheduler(context_length=256)
    (req,) = create_requests(1, 250, max_new_tokens=100, ignore_eos=True)
    res = run(s, [req])
    assert res["r0"]["output_ids"] == reference(req.input_ids, 6)
    assert res["r0"]["finish_reason"] == {"type": "length", "length": 6}


# ---- rejection ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda r: setattr(r, "input_ids", list(range(2, 34)) * 32), "context length is 1024"),
        (lambda r: setattr(r, "input_ids", []), "non-empty"),
        (lambda r: setattr(r, "input_ids", [5, VOCAB]), "input_ids must be integers"),
        (lambda r: setattr(r.sampling_params, "temperature", -1.0), "temperature"),
        (lambda r: setattr(r.sampling_params, "top_p", 0.0), "top_p"),
        (lambda r: setattr(r.sampling_params, "stop_token_ids", [VOCAB]), "stop_token_ids"),
    ],
)
def test_bad_requests_are_rejected_and_leave_no_state(mutate, message):
    s = create_scheduler()
    (req,) = create_requests(1, 10)
    mutate(req)
    with pytest.raises(ValueError, match=message):
        s.add_request(req)
    assert_all_free(s)
    assert not s.waiting and not s._live
    (good,) = create_requests(1, 10, max_new_tokens=2)
    assert run(s, [good])["r0"]["completion_tokens"] == 2  # the same rid is free to use


def test_prompt_larger_than_the_whole_kv_cache_is_rejected():
    s = create_scheduler(max_total_tokens=128)
    (req,) = create_requests(1, 200)
    with pytest.raises(ValueError, match="KV cache holds only 128"):
        s.add_request(req)
    assert_all_free(s)


def test_mixed_chunk_keeps_admitting_when_decode_rows_fill_the_chunk_budget():
    s = create_scheduler(chunked_prefill_size=4, enable_mixed_chunk=True)
    reqs = create_requests(6, 2, max_new_tokens=6)
    res = run(s, reqs)
    assert any(b.forward_mode == MIXED and b.extend_seq_lens_cpu[0] == 1 for b in s.model_runner.batches)
    assert all(res[r.rid]["output_ids"] == reference(r.input_ids, 6) for r in reqs)


def test_duplicate_rid_and_stop_strings_without_tokenizer_are_rejected():
    s = create_scheduler(decode_fn=None)
    a, b = create_requests(2, 10)
    s.add_request(a)
    with pytest.raises(ValueError, match="already running"):
        s.add_request(GenerateReqInput(rid="r0", input_ids=b.input_ids))
    b.sampling_params.stop = ["x"]
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        s.add_request(b)
    run(s)


# ---- streaming, sampling, stats --------------------------------------------------------


def test_streaming_sends_first_token_at_once_then_every_interval_and_on_finish():
    s = create_scheduler(stream_interval=3)
    stream_req, plain_req = create_requests(2, 12, max_new_tokens=8)
    stream_req.stream = True
    res = run(s, [stream_req, plain_req])
    assert [len(o.new_token_ids) for o in res["r0"]["outs"]] == [1, 3, 3, 1]
    assert [o.finished for o in res["r0"]["outs"]] == [False, False, False, True]
    assert [len(o.new_token_ids) for o in res["r1"]["outs"]] == [8]
    assert res["r0"]["output_ids"] == reference(stream_req.input_ids, 8)


def test_seeded_sampling_does_not_depend_on_batch_neighbours():
    params = dict(max_new_tokens=12, temperature=1.0, seed=1234)

    def sample(with_neighbours):
        s = create_scheduler()
        (req,) = create_requests(1, 16, rid_prefix="seeded")
        req.sampling_params = SamplingParams(**params)
        others = create_requests(5, [7, 30, 16, 3, 50], max_new_tokens=12, seed=9) if with_neighbours else []
        for o in others:
            o.sampling_params = SamplingParams(max_new_tokens=12, temperature=1.0)
        return run(s, [req] + others)["seeded0"]["output_ids"]

    alone = sample(False)
    assert alone == sample(True)
    assert alone != reference(create_requests(1, 16, rid_prefix="seeded")[0].input_ids, 12)  # really sampled


def test_stats_count_forwards_by_mode_and_include_runner_stats():
    s = create_scheduler(chunked_prefill_size=64)
    run(s, create_requests(2, 100, max_new_tokens=3))
    stats = s.get_stats()
    assert stats["num_forwards"] == len(s.model_runner.batches) == stats["fake_forwards"]
    assert stats["num_forwards_extend"] == modes(s).count(EXTEND)
    assert stats["num_forwards_decode"] == modes(s).count(DECODE)
    assert stats["num_forwards_mixed"] == 0
    assert stats["num_finished_reqs"] == 2 and stats["num_generated_tokens"] == 6
    assert stats["num_free_pages"] == stats["num_total_pages"] == 64
    assert stats["num_waiting_reqs"] == stats["num_running_reqs"] == 0


def test_scheduler_refuses_unresolved_server_args():
    args = ServerArgs(device="cpu")
    with pytest.raises(ValueError, match="resolve"):
        Scheduler(args, None)


@pytest.mark.parametrize("stop", ["日本", "€", "a😀b", "ÿ"])
def test_a_multibyte_stop_string_split_across_steps_stops_at_the_token_completing_it(stop):
    """Byte-level tokens: each character of the stop string spans 2-4 tokens, so the tail the
    scheduler decodes must cover its bytes, not its characters (a window of len(stop) ids
    would never see it whole)."""
    from sglang.srt.managers.schedule_batch import Req, check_finished
    from sglang.srt.tokenizer import ByteTokenizer

    tok = ByteTokenizer(512)
    prefix, suffix = tok.encode("x é 中 "), tok.encode("tail")
    stop_ids = tok.encode(stop)
    assert len(stop_ids) > len(stop)  # multi-byte: more tokens than characters
    req = Req(rid="r", origin_input_ids=[1, 2], sampling_params=SamplingParams(stop=[stop], max_new_tokens=100))
    reasons = []
    for t in prefix + stop_ids + suffix:  # one token per step
        req.output_ids.append(t)
        reasons.append(check_finished(req, frozenset(), 4096, tok.decode))
        if reasons[-1] is not None:
            break
    assert reasons[-1] == {"type": "stop", "matched": stop}
    assert len(reasons) == len(prefix) + len(stop_ids)  # the very token that completes it
    assert all(r is None for r in reasons[:-1])
