"""Triton side of page_table_list.PageTableList: entries of a per-token list read straight
from the page table (the same formula as PageTableList.slots_at)."""

import triton
import triton.language as tl


@triton.jit
def load_page_table_slots(row_ptr, cols, live, max_col, RATIO: tl.constexpr):
    """row[min(RATIO * col + RATIO - 1, max_col)] // RATIO where `live` and the raw slot is
    mapped (>= 0), else -1. row_ptr: the token's page-table row."""
    # int32 column math (a row has < 2**31 / RATIO entries): int64 offsets cost the indexer's
    # logits kernel ~80 registers per thread on sm_90
    raw = tl.load(row_ptr + tl.minimum(cols * RATIO + RATIO - 1, max_col), mask=live, other=-1)
    return tl.where(live & (raw >= 0), raw // RATIO, -1).to(tl.int32)
