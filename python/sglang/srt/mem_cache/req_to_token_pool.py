"""Maps (request slot, position) -> raw KV slot; one page table per request shared by every cache.

Raw slot of position p = page * page_size + p % page_size. Because pages are aligned to
page_size (a multiple of 128), the last token of compressed block i (ratio r) sits at a raw
slot s with s // r unique to that block, so the compressed entry lives at slot s // r of the
ratio-r pool: no separate page tables for the c4 / c128 / indexer pools.
"""

from __future__ import annotations

from typing import Dict, List

import numpy as np
import torch

from sglang.srt.mem_cache.allocator import FreeListAllocator, KVCacheExhausted
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
        self.pages = FreeListAllocator(num_pages - 1, first=1, what="KV page")
        self._pages_of: Dict[int, List[int]] = {}

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

    def free_req(self, req_slot: int) -> None:
        pages = self._pages_of.pop(req_slot)
        self.pages.free(pages)
        self.slots.free([req_slot])
        self.req_to_token[req_slot].zero_()


__all__ = ["ReqToTokenPool", "KVCacheExhausted", "PADDING_PAGE"]
