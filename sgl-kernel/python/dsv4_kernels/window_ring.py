"""Triton move of raw-KV rows from a step's staging rows into the requests' window rings
(reference.keep_window_rows_): one launch, one program per batch row, any row format (float
rows or FP8 row bytes).

No copy of the staging rows is needed first: a target is a ring row (below the staging rows)
or the row's own staging row, never another program's source.
"""

import triton
import triton.language as tl

from .host_math import next_power_of_2


@triton.jit
def _keep_window_rows_kernel(raw_ptr, keep_ptr, staging_start, row_stride, D, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    dst = tl.load(keep_ptr + t).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    live = cols < D
    row = tl.load(raw_ptr + (staging_start + t) * row_stride + cols, mask=live)
    tl.store(raw_ptr + dst * row_stride + cols, row, mask=live)


def keep_window_rows_(raw, staging_start, keep_loc):
    """See reference.keep_window_rows_; keep_loc as token_metadata's raw_keep_loc builds it."""
    n = keep_loc.shape[0]
    if n == 0:
        return raw
    if raw.stride(1) != 1:
        raise ValueError("keep_window_rows_: raw rows must be contiguous")
    D = raw.shape[1]
    _keep_window_rows_kernel[(n,)](raw, keep_loc, staging_start, raw.stride(0), D, BLOCK=next_power_of_2(D),
                                   num_warps=4)
    return raw
