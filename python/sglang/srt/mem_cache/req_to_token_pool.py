"""Maps (request slot, position) -> token slot; one page table per request shared by every cache.

Token ("raw") slot of position p = page * page_size + p % page_size. Raw KV itself is not stored
at it (it lives in per-request window rings, dsv4_kv_pool.py); the slot names the position so
that the compressed entries and indexer keys derive theirs. Because pages are aligned to
page_size (a multiple of 128), the last token of compressed block i (ratio r) sits at a raw
slot s with s // r unique to that block, so the compressed entry lives at slot s // r of the
ratio-r pool: no separate page tables for the c4 / c128 / indexer pools.

Pages are held with a count (allocator.RefCountedPageAllocator): a request holds every page of
its table, and a prefix cache (radix_cache.py) may hold the same full pages; a request's first
pages may be mapped from the cache (`map_cached_prefix`). When an allocation falls short, the
pool first asks `reclaimer` (the prefix cache's eviction) to free pages.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import numpy as np
import torch

from sglang.srt.mem_cache.allocator import FreeListAllocator, KVCacheExhausted, RefCountedPageAllocator
from sglang.srt.model_executor.host_to_device import to_device_async

PADDING_PAGE = 0  # never handed to a request; padded rows read it and write nothing


class ReqToTokenPool:
    def __init__(self, max_num_reqs: int, max_context_len: int, num_pages: int, page_size: int,
                 device: torch.device | str):
        if page_size % 128 != 0:
            raise ValueError(f"page_size must be a multiple of 128 (c128 blocks), got {page_size}")
        if num_pages < 2:
            raise ValueError("need at least 2 pages (page 0 is the padding page)")
        self.page_size = page_size
        self.max_context_len = max_context_len
        self.max_num_reqs = max_num_reqs
        # Row `max_num_reqs` is the padding request: all its positions map into page 0.
        self.padding_slot = max_num_reqs
        self.req_to_token = torch.zeros(
            (max_num_reqs + 1, max_context_len), dtype=torch.int32, device=device
        )
        self.slots = FreeListAllocator(max_num_reqs, what="request slot")
        self.pages = RefCountedPageAllocator(num_pages - 1, first=1, what="KV page")
        self._pages_of: Dict[int, List[int]] = {}
        # called with the number of pages missing before an allocation fails; returns pages freed
        self.reclaimer: Optional[Callable[[int], int]] = None

    @property
    def num_free_pages(self) -> int:
        return self.pages.num_free

    def pages_needed(self, req_slot: int | None, new_len: int) -> int:
        have = len(self._pages_of.get(req_slot, [])) if req_slot is not None else 0
        return max(0, -(-new_len // self.page_size) - have)

    def alloc_req(self) -> int:
        slot = self.slots.alloc(1)[0]
        self._pages_of[slot] = []
        return slot

    def ensure_capacity(self, req_slot: int, new_len: int) -> None:
        """Map positions [0, new_len) of the request; all-or-nothing on failure."""
        if new_len > self.max_context_len:
            raise ValueError(f"sequence length {new_len} exceeds max_context_len {self.max_context_len}")
        owned = self._pages_of[req_slot]
        need = self.pages_needed(req_slot, new_len)
        if need == 0:
            return
        if need > self.pages.num_free and self.reclaimer is not None:
            self.reclaimer(need - self.pages.num_free)
        new_pages = self.pages.alloc(need)  # raises KVCacheExhausted before touching anything
        start = len(owned) * self.page_size
        owned.extend(new_pages)
        end = len(owned) * self.page_size
        ps = self.page_size
        cols = min(end, self.max_context_len)
        # numpy (torch's CPU repeat_interleave wakes the OpenMP pool at any size); non-blocking
        # upload: a blocking one would wait for the forward in flight (overlap scheduling)
        pages = np.asarray(new_pages, dtype=np.int32)
        rows = torch.from_numpy((pages[:, None] * ps + np.arange(ps, dtype=np.int32)).reshape(-1)[: cols - start])
        self.req_to_token[req_slot, start:cols] = to_device_async(rows, self.req_to_token.device)

    def truncate(self, req_slot: int, new_len: int) -> None:
        """Keep positions [0, new_len) mapped and give back the pages past them (speculative
        positions that were rejected). Their page-table entries are left as they are: nothing
        reads past a request's length, and the next ensure_capacity rewrites them."""
        owned = self._pages_of[req_slot]
        keep = -(-new_len // self.page_size)
        if keep < len(owned):
            self.pages.free(owned[keep:])
            del owned[keep:]

    def pages_of(self, req_slot: int) -> List[int]:
        """The request's pages in position order (a copy)."""
        return list(self._pages_of[req_slot])

    def map_cached_prefix(self, req_slot: int, pages: List[int]) -> None:
        """Map positions [0, len(pages) * page_size) of a request that holds no page yet onto
        `pages` (full pages of a cached prefix), taking a hold on each."""
        if self._pages_of[req_slot]:
            raise ValueError(f"request slot {req_slot} already holds pages; a cached prefix maps first")
        n = len(pages) * self.page_size
        if n > self.max_context_len:
            raise ValueError(f"cached prefix of {n} tokens exceeds max_context_len {self.max_context_len}")
        if not pages:
            return
        self.pages.incref(pages)
        self._pages_of[req_slot].extend(pages)
        ps = self.page_size
        arr = np.asarray(pages, dtype=np.int32)
        rows = torch.from_numpy((arr[:, None] * ps + np.arange(ps, dtype=np.int32)).reshape(-1))
        self.req_to_token[req_slot, :n] = to_device_async(rows, self.req_to_token.device)

    def free_req(self, req_slot: int) -> None:
        pages = self._pages_of.pop(req_slot)
        self.pages.free(pages)
        self.slots.free([req_slot])
        self.req_to_token[req_slot].zero_()


__all__ = ["ReqToTokenPool", "KVCacheExhausted", "PADDING_PAGE"]
