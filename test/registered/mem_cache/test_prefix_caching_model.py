"""Prefix caching end to end on the real model (dsv4-tiny, CPU, fp32, greedy, page size 128):
outputs with prefix caching (the default) are the outputs with --disable-radix-cache, for prompts sharing prefixes
that end at every position mod 4 around the first two page boundaries (so the resumed
request's first ratio-4 block mixes cached and fresh rows at every offset), for a second
chat turn that extends the first turn's prompt and answer (a state taken during decode), and
for two requests sharing a prefix while the first is still prefilling it. The reported
cached_tokens are the page-aligned prefixes where a state was taken."""

import random

import pytest
import torch

from sglang.srt.managers import prefix_caching
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.test.runner_args import cpu_server_args

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")
P = 128
TINY = dict(model_path="dsv4-tiny", context_length=1024, max_total_tokens=8192, page_size=P)


@pytest.fixture(scope="module")
def runner():
    torch.manual_seed(0)
    return ModelRunner(cpu_server_args(**TINY, max_running_requests=8))


def _ids(rng, n, vocab):
    return [rng.randrange(2, vocab) for _ in range(n)]


def _req(rid, ids, max_new_tokens=4):
    return GenerateReqInput(rid=rid, input_ids=list(ids), return_logprob=True,
                            sampling_params=SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                                                           ignore_eos=True))


class Serving:
    """A scheduler over the shared runner; `run` serves a wave of requests to the end."""

    def __init__(self, runner, caching, base=TINY, **kw):
        args = dict(base, max_running_requests=runner.server_args.max_running_requests,
                    **({} if caching else {"disable_radix_cache": True}), **kw)
        self.s = Scheduler(ServerArgs(**args).resolve(cuda_available=args.get("device") == "cuda"), runner)
        self.free = self.s.pool.num_free_pages

    def run(self, reqs):
        for r in reqs:
            self.s.add_request(r)
        res = {}
        while self.s.has_work():
            for o in self.s.step():
                ids, lps, _ = res.get(o.rid, ([], [], 0))
                res[o.rid] = (ids + o.new_token_ids, lps + (o.new_logprobs or []), o.cached_tokens)
        return res

    def close(self):
        cache = self.s.prefix_caching
        if cache is not None:
            assert cache.tree.evictable_pages == cache.tree.cached_pages  # nothing left locked
            cache.tree.reset()
        assert self.s.pool.num_free_pages == self.free and self.s.pool.slots.num_free == self.s.pool.slots.capacity


def _same_outputs(got, expect):
    assert set(got) == set(expect)
    for rid in expect:
        assert got[rid][0] == expect[rid][0], rid
        torch.testing.assert_close(torch.tensor(got[rid][1]), torch.tensor(expect[rid][1]), atol=1e-4, rtol=0)


SHARED = [P - 3, P - 2, P - 1, P, P + 1, P + 2, P + 3, 2 * P - 2, 2 * P - 1, 2 * P, 2 * P + 1, 2 * P + 2, 2 * P + 3]


@pytest.mark.parametrize("chunk, mixed", [(P, False), (512, True)])
def test_shared_prefixes_ending_around_page_boundaries_give_the_uncached_outputs(runner, chunk, mixed):
    rng = random.Random(0)
    vocab = runner.config.vocab_size
    base = _ids(rng, 300, vocab)
    firsts, seconds, expect_cached = [], [], {}
    for s in SHARED:
        a, b = _ids(rng, 300 - s, vocab), _ids(rng, 290 - s, vocab)
        b[0] = a[0] + 1 if a[0] + 1 < vocab else 2  # the prompts share exactly s tokens
        firsts.append(_req(f"a{s}", base[:s] + a))
        seconds.append(_req(f"b{s}", base[:s] + b))
        # a first prompt of 300 tokens leaves states at the ends of its chunks (cut at page
        # boundaries): 128 and 256 with 128-token chunks; with 512-token chunks only 256, its
        # last boundary (a hit at 128 is never taken: no state there)
        boundaries = [P, 2 * P] if chunk == P else [2 * P]
        expect_cached[f"b{s}"] = max([L for L in boundaries if L <= s], default=0)
    kw = dict(chunked_prefill_size=chunk, enable_mixed_chunk=mixed)
    plain = Serving(runner, caching=False, **kw)
    expect = {**plain.run(firsts), **plain.run(seconds)}
    plain.close()
    cached = Serving(runner, caching=True, **kw)
    got = {**cached.run(firsts), **cached.run(seconds)}
    stats = cached.s.get_stats()
    cached.close()
    _same_outputs(got, expect)
    assert {rid: got[rid][2] for rid in expect_cached} == expect_cached
    # the first prompts also share base prefixes among themselves: every hit is counted once
    assert stats["prefix_cache_hit_tokens"] == sum(v[2] for v in got.values()) > sum(expect_cached.values())
    assert stats["prefix_cache_lookup_tokens"] == 300 * len(SHARED) + 290 * len(SHARED)
    assert stats["prefix_cache_hit_rate"] == pytest.approx(stats["prefix_cache_hit_tokens"] / stats["prefix_cache_lookup_tokens"])


def _chat(runner, caching):
    """A first turn whose decode passes position 256, then a second turn extending its prompt
    and answer: both turns' outputs."""
    rng = random.Random(1)
    vocab = runner.config.vocab_size
    prompt1, message = _ids(rng, 200, vocab), _ids(rng, 30, vocab)
    serving = Serving(runner, caching=caching)
    first = serving.run([_req("t1", prompt1, max_new_tokens=70)])["t1"]
    second = serving.run([_req("t2", prompt1 + first[0] + message, max_new_tokens=6)])
    serving.close()
    return first, second


def test_second_chat_turn_reuses_the_first_turns_prompt_and_answer(runner):
    out1_plain, expect = _chat(runner, caching=False)
    out1, got = _chat(runner, caching=True)
    assert out1[0] == out1_plain[0] and out1[2] == 0
    _same_outputs(got, expect)
    assert got["t2"][2] == 2 * P  # the state the first turn took in decode at position 256


def test_a_resume_without_the_window_rows_would_read_stale_raw_kv(runner, monkeypatch):
    """The cached prefix (256) is longer than dsv4-tiny's window (8): the second turn's first
    windows read positions 248..255 from its own window ring. Restoring everything but those
    rows (the slot's ring keeps what the first turn left there: its positions up to 270) gives
    other logprobs than the cache-free run, so the equality above depends on them."""
    W = runner.kv_pool.window
    assert 2 * P > W

    def restore_all_but_the_window(kv_pool, slot, state):
        ring = kv_pool.window_rows(slot, range(W))[0]
        kept = [raw[ring].clone() for raw in kv_pool.raw]
        real_restore(kv_pool, slot, state)
        for raw, rows in zip(kv_pool.raw, kept):
            raw[ring].copy_(rows)

    real_restore = prefix_caching.restore_resume_state
    _, expect = _chat(runner, caching=False)
    monkeypatch.setattr(prefix_caching, "restore_resume_state", restore_all_but_the_window)
    _, got = _chat(runner, caching=True)
    assert got["t2"][2] == 2 * P
    gaps = [abs(a - b) for a, b in zip(got["t2"][1], expect["t2"][1])]
    assert max(gaps) > 5e-4  # five times the tolerance the equality tests allow
    with pytest.raises(AssertionError):
        _same_outputs(got, expect)


@pytest.mark.parametrize("chunk", [P, 512])
def test_two_requests_sharing_a_prefix_while_it_is_filled(runner, chunk):
    rng = random.Random(2)
    vocab = runner.config.vocab_size
    prefix = _ids(rng, 300, vocab)
    reqs = lambda: [_req("x", prefix + _ids(random.Random(3), 10, vocab), max_new_tokens=8),  # noqa: E731
                    _req("y", prefix + _ids(random.Random(4), 12, vocab), max_new_tokens=8)]
    plain = Serving(runner, caching=False, chunked_prefill_size=chunk)
    expect = plain.run(reqs())
    plain.close()
    cached = Serving(runner, caching=True, chunked_prefill_size=chunk)
    got = cached.run(reqs())
    cached.close()
    _same_outputs(got, expect)
    # y was admitted while x still prefilled: x's pages up to its last boundary were in the tree
    assert got["y"][2] == 2 * P and got["x"][2] == 0


def test_resumed_extends_replay_from_breakable_graphs_with_the_eager_outputs():
    """Extends from a cached prefix and decodes replayed from graphs (the CPU emulator) give
    the cache-free eager outputs."""
    torch.manual_seed(0)
    graphs = ModelRunner(cpu_server_args(**TINY, max_running_requests=4, enable_breakable_cuda_graph=True,
                                         breakable_cuda_graph_tokens=[16, 64], cuda_graph_max_bs=4),
                         cuda_graph_on_cpu=True)
    rng = random.Random(5)
    vocab = graphs.config.vocab_size
    prefix = _ids(rng, 2 * P + 5, vocab)
    reqs = lambda: [_req("x", prefix + _ids(random.Random(6), 7, vocab)),  # noqa: E731
                    _req("y", prefix[:2 * P + 2] + _ids(random.Random(7), 20, vocab))]
    before = graphs.get_stats()
    cached = Serving(graphs, caching=True, chunked_prefill_size=64, enable_mixed_chunk=True)
    got = cached.run(reqs())
    cached.close()
    after = graphs.get_stats()
    torch.manual_seed(0)
    eager = ModelRunner(cpu_server_args(**TINY, max_running_requests=4))
    plain = Serving(eager, caching=False, chunked_prefill_size=64, enable_mixed_chunk=True)
    expect = plain.run(reqs())
    plain.close()
    _same_outputs(got, expect)
    assert got["y"][2] == 2 * P
    for kind in ("breakable_replays", "decode_graph_replays"):
        assert after[kind] > before[kind], kind


# ---- on an H200: dsv4-mini in bf16, FP8 KV, breakable CUDA graphs and mixed chunks -----------

GPU_MINI = dict(model_path="dsv4-mini", device="cuda", dtype="bfloat16", context_length=4096,
                max_total_tokens=64 * 1024, page_size=P, kv_cache_dtype="fp8_e4m3")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_cached_extends_replayed_from_graphs_give_the_uncached_outputs():
    """The same runner (real CUDA graphs) serves a wave of prompts sharing prefixes that end at
    every offset mod 4 around page boundaries, a second wave of chat turns extending the first
    wave's prompts and answers, once without and once with prefix caching. Greedy tokens are
    identical; logprobs agree to bf16 rounding (a resumed extend runs other batch shapes: on an
    H200 up to 0.15 apart, as bf16 logits of one request in different batches are)."""
    torch.manual_seed(0)
    runner = ModelRunner(cpu_server_args(**GPU_MINI, max_running_requests=16, enable_breakable_cuda_graph=True,
                                         breakable_cuda_graph_tokens=[64, 256, 1024],
                                         breakable_cuda_graph_max_tokens=1024, cuda_graph_max_bs=16))
    vocab = runner.config.vocab_size
    rng = random.Random(11)
    base = _ids(rng, 3 * P + 40, vocab)
    shared = [P - 1, P, P + 1, P + 2, 2 * P + 3, 3 * P - 2, 3 * P, 3 * P + 1]
    firsts = [_req(f"a{s}", base[:s] + _ids(rng, 400 - s, vocab), max_new_tokens=24) for s in shared]
    seconds = [_req(f"b{s}", base[:s] + _ids(rng, 37, vocab), max_new_tokens=24) for s in shared]
    kw = dict(base=GPU_MINI, chunked_prefill_size=256, enable_mixed_chunk=True)

    def serve(caching):
        serving = Serving(runner, caching=caching, **kw)
        out = {**serving.run(firsts), **serving.run(seconds)}
        turns = [_req(f"t{s}", firsts[i].input_ids + out[f"a{s}"][0] + _ids(random.Random(s), 20, vocab),
                      max_new_tokens=16) for i, s in enumerate(shared)]
        out.update(serving.run(turns))
        serving.close()
        return out

    before = runner.get_stats()
    expect = serve(caching=False)
    got = serve(caching=True)
    after = runner.get_stats()
    runner.shutdown()
    assert set(got) == set(expect)
    for rid in expect:
        assert got[rid][0] == expect[rid][0], rid
        torch.testing.assert_close(torch.tensor(got[rid][1]), torch.tensor(expect[rid][1]), atol=0.25, rtol=0)
    assert all(got[f"t{s}"][2] >= 3 * P for s in shared)  # each chat turn resumes past its first prompt
    assert sum(v[2] for v in got.values()) > 0 == sum(v[2] for v in expect.values())
    assert after["breakable_replays"] > before["breakable_replays"]
