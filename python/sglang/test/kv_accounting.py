"""What a scheduler's KV pool looks like once no request holds KV, with or without a prefix
cache: every request slot free, every page free or held by the prefix cache alone (cached,
evictable: the pool frees it on demand). A page a finished request leaked fails it whether
or not the cache also holds that page."""

from __future__ import annotations


def _cache_only_pages(sched) -> list:
    return sched.prefix_caching.cache_only_pages() if sched.prefix_caching is not None else []


def free_or_cache_only_pages(sched) -> int:
    """Pages that are free or held by the prefix cache alone: the whole pool once no request
    holds KV."""
    return sched.pool.num_free_pages + len(_cache_only_pages(sched))


def assert_no_request_holds_kv(sched) -> None:
    pool = sched.pool
    cache_only = _cache_only_pages(sched)
    assert pool.slots.num_free == pool.slots.capacity, "a request slot is still held"
    assert pool.num_free_pages + len(cache_only) == pool.pages.capacity, (
        f"{pool.pages.capacity - pool.num_free_pages - len(cache_only)} pages held by no request and "
        f"not by the prefix cache alone")
    assert sched.num_evictable_pages == len(cache_only), "a cached page is still locked"


def assert_stats_no_request_holds_kv(stats: dict) -> None:
    """The same from a scheduler's (or the DP ranks' summed) stats: free pages plus the prefix
    cache's evictable pages are the pool, and the cache holds no page a request locks."""
    assert stats["num_free_pages"] + stats["num_evictable_pages"] == stats["num_total_pages"]
    assert stats.get("prefix_cache_cached_pages", 0) == stats["num_evictable_pages"]
    if stats.get("num_free_req_slots") is not None:
        assert stats["num_free_req_slots"] == stats["num_total_req_slots"]
