"""Triton logits of the c4 sparse indexer, followed by a static-shape torch.topk.

I(t, j) = sum_h w[t,h] * relu(q[t,h] . K[cand(t, j)]). The candidates are a [T, C] slot list,
or (the runtime's case) a PageTableList read straight from the page table, so no [T, C]
list exists. Heads are the M side of the dot so a tile of gathered keys is read once per
token. Masked candidates get -inf and never win.
"""

import torch
import triton
import triton.language as tl

from ._dot import dot_precision
from ._page_table import load_page_table_slots
from .page_table_list import PageTableList
from .reference import select_topk_slots

# Bound on the fp32 logits scratch (elements); longer batches are scored in token chunks.
MAX_LOGITS_ELEMENTS = 1 << 26


@triton.jit
def _indexer_logits_kernel(
    q_ptr, w_ptr, key_ptr, slots_ptr, rows_ptr, max_col, len_ptr, logits_ptr,
    stride_qt, stride_qh, stride_wt, stride_key, stride_st, stride_lt,
    NH, DI, C,
    TILES_PER_PROG: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr, PAGED: tl.constexpr, RATIO: tl.constexpr,
):
    """PAGED: slots_ptr is the page table (row stride stride_st) and rows_ptr each token's row;
    else slots_ptr is the [T, C] list."""
    t = tl.program_id(0).to(tl.int64)
    if PAGED:
        list_row = slots_ptr + tl.load(rows_ptr + t).to(tl.int64) * stride_st
    else:
        list_row = slots_ptr + t * stride_st
    offs_h = tl.arange(0, BLOCK_H)
    h_mask = offs_h < NH
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < DI
    q = tl.load(q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    w = tl.load(w_ptr + t * stride_wt + offs_h, mask=h_mask, other=0.0).to(tl.float32)
    length = tl.load(len_ptr + t)
    for i in tl.static_range(TILES_PER_PROG):
        offs_n = (tl.program_id(1) * TILES_PER_PROG + i) * BLOCK_N + tl.arange(0, BLOCK_N)
        if PAGED:
            slot = load_page_table_slots(list_row, offs_n, offs_n < length, max_col, RATIO)
        else:
            slot = tl.load(list_row + offs_n, mask=offs_n < length, other=-1)
        valid = slot >= 0
        k = tl.load(key_ptr + slot.to(tl.int64)[:, None] * stride_key + offs_d[None, :],
                    mask=valid[:, None] & d_mask[None, :], other=0.0)
        dots = tl.maximum(tl.dot(q, tl.trans(k), input_precision=DOT_PREC), 0.0)
        score = tl.sum(dots * w[:, None], 0)
        tl.store(logits_ptr + t * stride_lt + offs_n, tl.where(valid, score, float("-inf")),
                 mask=offs_n < C)


def indexer_logits(q_idx, weights, key_pool, cand_slots, cand_len, logits=None):
    """logits [T, C] fp32 (see reference.indexer_logits); cand_slots: a [T, C] list or a
    PageTableList of width C."""
    T, NH, DI = q_idx.shape
    paged = isinstance(cand_slots, PageTableList)
    if paged:
        C, table, rows, ratio = cand_slots.width, cand_slots.rtt, cand_slots.rows, cand_slots.ratio
        assert rows.shape[0] == T and table.stride(-1) == 1
    else:
        C, table, rows, ratio = cand_slots.shape[1], cand_slots, cand_len, 1  # rows never read
    assert q_idx.stride(-1) == 1 and key_pool.stride(-1) == 1 and table.stride(-1) == 1
    assert key_pool.dtype == q_idx.dtype and weights.stride(-1) == 1
    if logits is None:
        logits = torch.empty(T, C, dtype=torch.float32, device=q_idx.device)
    if T == 0 or C == 0:
        return logits
    block_n = 64
    tiles = 4 if C >= 4 * block_n else 1
    grid = (T, triton.cdiv(C, block_n * tiles))
    _indexer_logits_kernel[grid](
        q_idx, weights, key_pool, table, rows, table.shape[1] - 1, cand_len, logits,
        q_idx.stride(0), q_idx.stride(1), weights.stride(0), key_pool.stride(0),
        table.stride(0), logits.stride(0), NH, DI, C,
        TILES_PER_PROG=tiles, BLOCK_H=max(16, triton.next_power_of_2(NH)), BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(DI), DOT_PREC=dot_precision(q_idx.dtype), PAGED=paged, RATIO=ratio,
        num_warps=4, num_stages=2,
    )
    return logits


def indexer_topk(q_idx, weights, key_pool, cand_slots, cand_len, topk, out_slots):
    T = q_idx.shape[0]
    C = cand_slots.width if isinstance(cand_slots, PageTableList) else cand_slots.shape[1]
    chunk = max(1, MAX_LOGITS_ELEMENTS // max(C, 1))
    # A static Python loop over token chunks: the chunk count depends only on T and C.
    for start in range(0, T, chunk):
        sl = slice(start, min(start + chunk, T))
        logits = indexer_logits(q_idx[sl], weights[sl], key_pool, cand_slots[sl], cand_len[sl])
        select_topk_slots(logits, cand_slots[sl], topk, out_slots[sl])
    return out_slots
