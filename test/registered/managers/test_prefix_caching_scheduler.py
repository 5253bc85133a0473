"""Prefix caching in the scheduler with a fake runner that really reads the KV cache (it
writes each fed token at its page-table slot and derives the next token from the whole
sequence read back), under memory pressure: eviction, retraction, aborts and overlap
scheduling. Outputs equal the cache-free reference, and after every step each page's holder
count is its holders (request page tables + tree nodes), free + held-by-requests +
cached-only = pool, and each node's lock count is the requests that lock it or a descendant.
Also: the cache is on by default and its pages are in the stats, and a new scheduler over the
same runner starts with the whole pool free."""

import dataclasses
import random
from types import SimpleNamespace

import pytest
import torch

from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.mem_cache.req_to_token_pool import ReqToTokenPool
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs

VOCAB = 64
P = 128


def next_token_of(tokens):
    h = sum((j + 1) * t for j, t in enumerate(tokens))
    return 2 + (h * 2654435761) % 1000003 % (VOCAB - 2)


def reference(prompt, n):
    toks, out = list(prompt), []
    for _ in range(n):
        out.append(next_token_of(toks))
        toks.append(out[-1])
    return out


class KVReadingRunner:
    def __init__(self, args):
        self.config = SimpleNamespace(vocab_size=VOCAB, eos_token_id=1)
        self.device = torch.device("cpu")
        num_pages = args.max_total_tokens // P + 1
        self.req_to_token_pool = ReqToTokenPool(args.max_running_requests, args.context_length, num_pages, P, "cpu")
        self.kv_token = torch.full((num_pages * P,), -1, dtype=torch.int64)

    def forward(self, fb):
        rtt = self.req_to_token_pool.req_to_token
        self.kv_token[rtt[fb.token_req_slot, fb.positions].long()] = fb.input_ids
        logits = torch.zeros(fb.batch_size, VOCAB)
        for i, (slot, n) in enumerate(zip(fb.token_req_slot[fb.last_token_indices()].tolist(), fb.seq_lens_cpu)):
            logits[i, next_token_of(self.kv_token[rtt[slot, :n].long()].tolist())] = 5.0
        return SimpleNamespace(next_token_logits=logits)

    def copy_kv_page(self, src, dst):
        self.kv_token[dst * P:(dst + 1) * P] = self.kv_token[src * P:(src + 1) * P]


def make_scheduler(pages, caching=True, **kw):
    settings = dict(model_path="dsv4-tiny", device="cpu", context_length=2048, max_total_tokens=pages * P,
                    max_running_requests=8, chunked_prefill_size=256, page_size=P,
                    **({} if caching else {"disable_radix_cache": True}))
    args = ServerArgs(**dict(settings, **kw)).resolve(cuda_available=False)
    return Scheduler(args, KVReadingRunner(args))


def check_invariants(s):
    pool, tree = s.pool, s.prefix_caching.tree
    holders = [r for r in s._live.values() if r.req_pool_idx is not None]
    by_reqs = {}
    for r in holders:
        pages = pool.pages_of(r.req_pool_idx)
        assert len(pages) == len(set(pages)) == -(-r.prefix_len // P)
        for p in pages:
            by_reqs[p] = by_reqs.get(p, 0) + 1
    in_tree = tree.held_pages()
    assert len(in_tree) == len(set(in_tree)), "a page held twice by the tree"
    for p in range(1, pool.pages.capacity + 1):
        assert pool.pages.refcount(p) == by_reqs.get(p, 0) + in_tree.count(p)
    cached_only = set(in_tree) - set(by_reqs)
    assert pool.num_free_pages + len(by_reqs) + len(cached_only) == pool.pages.capacity
    expect = {}
    for r in holders:
        n = r.cache_node
        while n is not None and n is not tree.root:
            expect[id(n)] = expect.get(id(n), 0) + 1
            n = n.parent
    assert all(n.lock_ref == expect.get(id(n), 0) for n in tree.nodes())
    assert all(r.cache_node is None and r.req_pool_idx is None for r in s.waiting)


@pytest.mark.parametrize("seed, overlap, mixed, policy", [(0, True, False, "fcfs"), (1, False, True, "fcfs"),
                                                          (2, True, True, "fcfs"), (3, True, True, "lpm")])
def test_random_shared_prefix_traffic_under_memory_pressure(seed, overlap, mixed, policy):
    rng = random.Random(seed)
    stems = [[rng.randrange(2, VOCAB) for _ in range(4 * P)] for _ in range(3)]
    s = make_scheduler(pages=14, disable_overlap_schedule=not overlap, enable_mixed_chunk=mixed,
                       schedule_policy=policy)
    prompts, max_new, aborted, results = {}, {}, set(), {}
    next_id = 0

    def add(prompt):
        nonlocal next_id
        rid = f"r{next_id}"
        prompts[rid], max_new[rid] = prompt, rng.randrange(1, 160)
        s.add_request(GenerateReqInput(rid=rid, input_ids=prompt, sampling_params=SamplingParams(
            max_new_tokens=max_new[rid], temperature=0.0, ignore_eos=True)))
        next_id += 1

    for step in range(3000):
        if next_id < 60 and rng.random() < 0.3:
            stem = rng.choice(stems)
            add(stem[:rng.randrange(0, 4 * P)] + [rng.randrange(2, VOCAB) for _ in range(rng.randrange(1, 200))])
        if rng.random() < 0.02 and s._live:
            rid = rng.choice(sorted(s._live))
            s.abort_request(rid)
            aborted.add(rid)
        for o in s.step():
            ids, _ = results.get(o.rid, ([], None))
            results[o.rid] = (ids + o.new_token_ids, o)
            # a next chat turn (under this pressure its tail is mostly evicted before it is admitted)
            chat = prompts[o.rid] + results[o.rid][0]
            if o.finished and o.rid not in aborted and next_id < 60 and len(chat) < 6 * P and rng.random() < 0.5:
                add(chat + [rng.randrange(2, VOCAB) for _ in range(rng.randrange(1, 100))])
        check_invariants(s)
        if next_id >= 60 and not s.has_work():
            break
    assert not s.has_work()
    done = [rid for rid in prompts if rid not in aborted]
    for rid in done:
        assert results[rid][0] == reference(prompts[rid], max_new[rid]), rid
    stats = s.get_stats()
    assert stats["prefix_cache_hits"] > 5 and stats["prefix_cache_evicted_pages"] > 0
    assert stats["num_retracted_reqs"] > 0 and aborted
    assert stats["prefix_cache_hit_tokens"] == sum(results[rid][1].cached_tokens for rid in done if rid in results) \
        + sum(results[rid][1].cached_tokens for rid in aborted if rid in results)
    assert stats["prefix_cache_cached_tokens"] == sum(len(n.key) for n in s.prefix_caching.tree.nodes())
    tree = s.prefix_caching.tree
    assert tree.evictable_pages == tree.cached_pages  # no request holds a lock any more
    tree.reset()
    assert s.pool.num_free_pages == s.pool.pages.capacity and s.pool.slots.num_free == s.pool.slots.capacity


def test_a_request_that_can_never_fit_fails_without_leaking_pages_or_locks():
    s = make_scheduler(pages=4)
    shared = [5] * (2 * P)
    s.add_request(GenerateReqInput(rid="a", input_ids=shared + [7], sampling_params=SamplingParams(
        max_new_tokens=2, temperature=0.0, ignore_eos=True)))
    while s.has_work():
        s.step()
    # b takes a's cached 2 pages, then its decode outgrows the whole pool (4 pages)
    s.add_request(GenerateReqInput(rid="b", input_ids=shared + [9] * (2 * P - 6), sampling_params=SamplingParams(
        max_new_tokens=20, temperature=0.0, ignore_eos=True)))
    outs = []
    while s.has_work():
        outs += s.step()
        check_invariants(s)
    assert outs[-1].rid == "b" and "more than the whole pool" in outs[-1].error
    assert outs[-1].cached_tokens == 2 * P
    tree = s.prefix_caching.tree
    assert tree.evictable_pages == tree.cached_pages
    tree.reset()
    assert s.pool.num_free_pages == s.pool.pages.capacity


@pytest.mark.parametrize("overlap", [True, False])
def test_chat_turns_resume_from_the_tail_their_last_answer_left(overlap):
    """Four sessions of four turns, interleaved: each turn's prompt is the session so far plus a
    new message; with room in the pool, every later turn resumes exactly where the previous
    answer's computed tokens end (inside a page), and every output is the reference's."""
    rng = random.Random(7)
    s = make_scheduler(pages=60, disable_overlap_schedule=not overlap)
    chats = {k: [rng.randrange(2, VOCAB) for _ in range(rng.randrange(100, 300))] for k in range(4)}
    computed = {}  # session -> tokens with KV after its last turn (the last sampled one has none)
    expect_cached, got = {}, {}
    for turn in range(4):
        max_new = {k: rng.randrange(5, 60) for k in chats}
        for k, chat in chats.items():
            expect_cached[f"{k}.{turn}"] = computed.get(k, 0)
            s.add_request(GenerateReqInput(rid=f"{k}.{turn}", input_ids=list(chat), sampling_params=SamplingParams(
                max_new_tokens=max_new[k], temperature=0.0, ignore_eos=True)))
        outs = {}
        while s.has_work():
            for o in s.step():
                outs[o.rid] = (outs.get(o.rid, ([], None))[0] + o.new_token_ids, o)
            check_invariants(s)
        for k, chat in chats.items():
            ids, last = outs[f"{k}.{turn}"]
            assert ids == reference(chat, max_new[k])
            got[f"{k}.{turn}"] = last.cached_tokens
            computed[k] = len(chat) + max_new[k] - 1
            chats[k] = chat + ids + [rng.randrange(2, VOCAB) for _ in range(rng.randrange(1, 40))]
    assert got == expect_cached and any(v % P for v in got.values())
    stats = s.get_stats()
    assert stats["prefix_cache_evicted_pages"] == 0
    s.prefix_caching.tree.reset()
    assert s.pool.num_free_pages == s.pool.pages.capacity


@pytest.mark.parametrize("policy, order, max_waiting", [("fcfs", ["x", "y", "z", "w"], 128),
                                                        ("lpm", ["y", "w", "z", "x"], 128),
                                                        ("lpm", ["x", "y", "w", "z"], 3)])
def test_lpm_admits_the_longest_cached_prefix_first(policy, order, max_waiting, monkeypatch):
    """With one request running at a time, admission order is completion order: fcfs keeps
    arrival order, lpm takes the waiting request with the longest cached prefix first (arrival
    order among equals) once no more than LPM_MAX_WAITING wait (with 3, four waiting start in
    arrival order: x first), and every output is the reference's either way. Matches end where
    the warm-up request left states: 2P (its first chunk's end) and 3P."""
    from sglang.srt.managers import prefix_caching

    monkeypatch.setattr(prefix_caching, "LPM_MAX_WAITING", max_waiting)
    rng = random.Random(3)
    base = [rng.randrange(2, VOCAB) for _ in range(3 * P + 7)]
    s = make_scheduler(pages=30, max_running_requests=1, schedule_policy=policy)
    _serve_one_after_another(s, base, ["warm"])
    prompts = {"x": [rng.randrange(2, VOCAB) for _ in range(2 * P)], "y": base[:3 * P] + [9] * 20,
               "z": base[:2 * P] + [11] * 30, "w": base[:3 * P] + [12] * 5}
    for rid, prompt in prompts.items():
        s.add_request(GenerateReqInput(rid=rid, input_ids=prompt, sampling_params=SamplingParams(
            max_new_tokens=4, temperature=0.0, ignore_eos=True)))
    done, outs = [], {}
    while s.has_work():
        for o in s.step():
            outs[o.rid] = outs.get(o.rid, []) + o.new_token_ids
            if o.finished:
                done.append(o.rid)
        check_invariants(s)
    assert done == order
    assert all(outs[rid] == reference(prompt, 4) for rid, prompt in prompts.items())


def test_lpm_needs_the_prefix_cache():
    with pytest.raises(ValueError, match="--schedule-policy lpm .* prefix cach"):
        make_scheduler(pages=14, caching=False, schedule_policy="lpm")


def _serve_one_after_another(s, prompt, rids):
    """Each request of `prompt` served to its end before the next is added: their last outputs."""
    last = []
    for rid in rids:
        s.add_request(GenerateReqInput(rid=rid, input_ids=prompt, sampling_params=SamplingParams(max_new_tokens=1)))
        outs = []
        while s.has_work():
            outs += s.step()
        last.append(outs[-1])
    return last


def test_with_the_radix_cache_disabled_nothing_is_cached():
    s = make_scheduler(pages=14, caching=False)
    assert s.prefix_caching is None and s.pool.reclaimer is None
    assert [o.cached_tokens for o in _serve_one_after_another(s, [3] * (2 * P + 5), ("a", "b"))] == [0, 0]
    assert s.pool.num_free_pages == s.pool.pages.capacity
    assert "prefix_cache_hit_rate" not in s.get_stats() and s.get_stats()["prefix_caching"] is False


def test_cache_is_on_by_default_and_its_pages_are_counted_in_the_stats():
    s = make_scheduler(pages=14)
    assert s.prefix_caching is not None and s.server_args.disable_radix_cache is False
    last = _serve_one_after_another(s, [3] * (2 * P + 5), ("a", "b"))
    # b resumed after a's two cached pages (a's tail, 5 tokens past them, would be the whole prompt)
    assert [o.cached_tokens for o in last] == [0, 2 * P]
    stats = s.get_stats()
    assert stats["num_evictable_pages"] == stats["prefix_cache_cached_pages"] == 3  # a tail's page too
    assert stats["prefix_cache_cached_tokens"] == 2 * P + 5
    assert stats["num_free_pages"] + stats["num_evictable_pages"] == stats["num_total_pages"] == 14
    assert sorted(s.prefix_caching.cache_only_pages()) == sorted(s.prefix_caching.tree.held_pages())


def test_a_new_scheduler_over_the_same_runner_gets_the_whole_pool_back():
    first = make_scheduler(pages=14)
    first.add_request(GenerateReqInput(rid="a", input_ids=[3] * (2 * P + 5), sampling_params=SamplingParams(
        max_new_tokens=1)))
    while first.has_work():
        first.step()
    assert first.pool.num_free_pages == 14 - 3 and first.num_evictable_pages == 3  # 2 pages and a tail
    # the earlier cache's pages are dropped, whether the next scheduler caches or not
    on = Scheduler(first.server_args, first.model_runner)
    assert on.pool is first.pool and on.pool.num_free_pages == 14 and on.pool.reclaimer is not None
    on.add_request(GenerateReqInput(rid="b", input_ids=[3] * (2 * P + 5), sampling_params=SamplingParams(
        max_new_tokens=1)))
    while on.has_work():
        on.step()
    assert on.pool.num_free_pages == 14 - 3
    off = Scheduler(dataclasses.replace(first.server_args, enable_prefix_caching=False, disable_radix_cache=True),
                    first.model_runner)
    assert off.prefix_caching is None and off.pool.reclaimer is None and off.pool.num_free_pages == 14
