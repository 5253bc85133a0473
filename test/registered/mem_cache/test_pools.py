"""Request->token pool and page accounting: positions map to page * P + pos % P, page 0 (the
padding page) is never handed out, allocation is all-or-nothing with a clear error, and once
every request is freed every page and request slot is free again."""

import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from dsv4_harness import Session, prefill_in_chunks, run_step  # noqa: E402

from sglang.srt.mem_cache.allocator import KVCacheExhausted  # noqa: E402
from sglang.srt.mem_cache.req_to_token_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.model_executor.model_runner import ModelRunner  # noqa: E402
from sglang.test.runner_args import cpu_server_args  # noqa: E402

P = 128


pytestmark = pytest.mark.usefixtures("single_intra_op_thread")


def _pool(num_pages=5, max_num_reqs=3, max_context_len=1024):
    return ReqToTokenPool(max_num_reqs, max_context_len, num_pages, P, "cpu")


def _pages_of_row(pool, slot, length):
    """The pages a request's positions [0, length) map to, read back from req_to_token."""
    row = pool.req_to_token[slot, :length].long()
    return (row // P).tolist()


def test_positions_map_to_page_times_page_size_plus_offset():
    pool = _pool(num_pages=9)
    a, b = pool.alloc_req(), pool.alloc_req()
    pool.ensure_capacity(a, 100)
    pool.ensure_capacity(b, 200)  # interleave the two requests' pages
    pool.ensure_capacity(a, 300)
    for slot, n in ((a, 300), (b, 200)):
        row = pool.req_to_token[slot, :n].long()
        pos = torch.arange(n)
        assert torch.equal(row % P, pos % P)
        pages = row // P
        for k in range(0, n, P):  # one page per aligned range of P positions
            assert (pages[k:k + P] == pages[k]).all()
        first_of_page = pages[::P].tolist()
        assert len(set(first_of_page)) == len(first_of_page)
    pages_a, pages_b = set(_pages_of_row(pool, a, 300)), set(_pages_of_row(pool, b, 200))
    assert len(pages_a) == 3 and len(pages_b) == 2 and not pages_a & pages_b
    assert pool.num_free_pages == 8 - 5


def test_page_zero_is_never_handed_out():
    pool = _pool(num_pages=5, max_num_reqs=4)
    slots = [pool.alloc_req() for _ in range(4)]
    for s in slots:
        pool.ensure_capacity(s, P)  # one page each: every allocatable page
    assert pool.num_free_pages == 0
    handed = sorted(p for s in slots for p in set(_pages_of_row(pool, s, P)))
    assert handed == [1, 2, 3, 4]
    with pytest.raises(KVCacheExhausted):
        pool.ensure_capacity(slots[0], P + 1)


def test_ensure_capacity_is_all_or_nothing_with_a_clear_error():
    pool = _pool(num_pages=5)  # 4 usable pages
    a, b = pool.alloc_req(), pool.alloc_req()
    pool.ensure_capacity(a, 3 * P)
    pool.ensure_capacity(b, 10)
    row_before = pool.req_to_token[b].clone()
    with pytest.raises(KVCacheExhausted) as err:
        pool.ensure_capacity(b, 3 * P)  # needs 2 more pages, 0 free
    msg = str(err.value)
    assert re.search(r"\b2\b", msg) and re.search(r"\b0\b", msg), msg  # how many needed / free
    assert "page" in msg
    assert pool.num_free_pages == 0
    assert torch.equal(pool.req_to_token[b], row_before)  # nothing half-mapped
    pool.ensure_capacity(b, P)  # still within its one page: fine
    pool.free_req(a)
    pool.ensure_capacity(b, 3 * P)  # now it fits
    assert pool.num_free_pages == 1


def test_capacity_past_the_context_length_is_refused_without_allocating():
    pool = _pool(num_pages=9, max_context_len=300)
    a = pool.alloc_req()
    with pytest.raises(ValueError, match="300"):
        pool.ensure_capacity(a, 301)
    assert pool.num_free_pages == 8
    pool.ensure_capacity(a, 300)
    assert pool.num_free_pages == 8 - 3


def test_request_slots_are_bounded_and_freeing_returns_everything():
    pool = _pool(num_pages=9, max_num_reqs=3)
    free_pages, free_slots = pool.num_free_pages, pool.slots.num_free
    slots = [pool.alloc_req() for _ in range(3)]
    assert len(set(slots)) == 3 and pool.padding_slot not in slots
    with pytest.raises(KVCacheExhausted):
        pool.alloc_req()
    pool.ensure_capacity(slots[0], 500)
    pool.ensure_capacity(slots[1], 129)
    with pytest.raises(KVCacheExhausted):
        pool.ensure_capacity(slots[2], 5 * P)  # 4 pages needed, 2 free: the failed allocation
    for s in slots:
        pool.free_req(s)
    assert pool.num_free_pages == free_pages and pool.slots.num_free == free_slots
    assert int(pool.req_to_token[:3].abs().sum()) == 0
    with pytest.raises((ValueError, KeyError)):
        pool.free_req(slots[0])  # double free
    # everything can be handed out again
    s = pool.alloc_req()
    pool.ensure_capacity(s, 8 * P)
    assert pool.num_free_pages == 0


def test_running_requests_through_the_runner_leaves_no_pages_behind():
    runner = ModelRunner(cpu_server_args(model_path="dsv4-tiny", dtype="float32", device="cpu",
                                         context_length=512, max_total_tokens=6 * P, max_running_requests=4))
    rtp = runner.req_to_token_pool
    free_pages, free_slots = rtp.num_free_pages, rtp.slots.num_free
    assert free_pages == 6
    g = torch.Generator().manual_seed(0)
    toks = [torch.randint(2, 512, (n,), generator=g).tolist() for n in (200, 130, 40)]
    fresh = prefill_in_chunks(runner, toks[2], [40])[0]  # reference on untouched pools

    a, b, c = Session(runner), Session(runner), Session(runner)
    run_step(runner, [a, b], [toks[0][:150], toks[1][:100]])
    run_step(runner, [a, b, c], [toks[0][150:], toks[1][100:], toks[2][:10]])
    assert rtp.num_free_pages == free_pages - 2 - 2 - 1
    with pytest.raises(KVCacheExhausted):
        run_step(runner, [c], [list(range(2, 2 + 400))])  # c would need 3 more pages, 1 free
    assert rtp.num_free_pages == 1
    for s in (a, b, c):
        s.release()
    assert rtp.num_free_pages == free_pages and rtp.slots.num_free == free_slots

    # Reused slots and pages hold stale KV and compressor state; a new request must not see it.
    again = prefill_in_chunks(runner, toks[2], [40])[0]
    assert torch.equal(again, fresh)
    assert rtp.num_free_pages == free_pages
