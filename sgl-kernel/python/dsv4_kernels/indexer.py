"""Triton logits of the c4 sparse indexer, followed by a static-shape torch.topk.

I(t, j) = sum_h w[t,h] * relu(q[t,h] . K[cand(t, j)]). The candidates are a [T, C] slot list,
or (the runtime's case) a PageTableList read straight from the page table, so no [T, C]
list exists. Heads are the M side of the dot so a tile of gathered keys is read once per
token. Masked candidates get -inf and never win. Keys are float rows in q's dtype or packed
FP4 rows (index_key_fp4.py, release numerics), decoded exactly to q's dtype as a tile is
gathered: the same dot as float keys holding those values, so the same logits bit for bit.

`indexer_topk` is three launches per chunk of tokens: the logits kernel writes each score as
the deterministic top-k's int64 key (reference.topk_indices: the score's order-preserving
bits, then the reversed column), one torch.topk over the keys, and a kernel that decodes the
chosen keys into slots. The reference's ~25 small torch ops cost ~0.65 ms of host time per
c4 layer in every breakable-graph replay (benchmark/bcg/profile_bcg_step.py, docs/benchmarks.md).
"""

import torch
import triton
import triton.language as tl

from ._dot import dot_precision
from ._page_table import load_page_table_slots
from .host_math import cdiv, next_power_of_2
from .page_table_list import kernel_list_args, list_width
from .quant_reference import FP4_BLOCK
from .reference import index_key_layout

# Bound on the fp32 logits scratch (elements); longer batches are scored in token chunks.
MAX_LOGITS_ELEMENTS = 1 << 26


@triton.jit
def _indexer_logits_kernel(
    q_ptr, w_ptr, key_ptr, slots_ptr, rows_ptr, max_col, len_ptr, logits_ptr,
    stride_qt, stride_qh, stride_wt, stride_key, stride_st, stride_lt,
    NH, DI, C,
    TILES_PER_PROG: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr, PAGED: tl.constexpr, RATIO: tl.constexpr,
    KEYS: tl.constexpr, FP4_KEYS: tl.constexpr, FP4_BLOCK: tl.constexpr,
):
    """PAGED: slots_ptr is the page table (row stride stride_st) and rows_ptr each token's row;
    else slots_ptr is the [T, C] list. KEYS: store int64 top-k keys instead of fp32 logits.
    FP4_KEYS: key rows are packed FP4 bytes (index_key_fp4.py), decoded to q's dtype (exact)."""
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
        if FP4_KEYS:
            k = _fp4_key_tile(key_ptr + slot.to(tl.int64)[:, None] * stride_key, offs_d,
                              valid[:, None] & d_mask[None, :], DI, FP4_BLOCK).to(q.dtype)
        else:
            k = tl.load(key_ptr + slot.to(tl.int64)[:, None] * stride_key + offs_d[None, :],
                        mask=valid[:, None] & d_mask[None, :], other=0.0)
        dots = tl.maximum(tl.dot(q, tl.trans(k), input_precision=DOT_PREC), 0.0)
        score = tl.sum(dots * w[:, None], 0)
        score = tl.where(valid, score, float("-inf"))
        if KEYS:
            tl.store(logits_ptr + t * stride_lt + offs_n, _topk_key(score, offs_n, C), mask=offs_n < C)
        else:
            tl.store(logits_ptr + t * stride_lt + offs_n, score, mask=offs_n < C)


@triton.jit
def _fp4_key_tile(row_ptr, offs_d, mask, DI, FP4_BLOCK: tl.constexpr):
    """fp32 values of packed FP4 key rows (row_ptr [N, 1] row starts) at dims offs_d: element d's
    code from byte d / 2 (low nibble for even d), its block's e8m0 byte after the DI / 2 code
    bytes; masked lanes read as 0. Every value is an e2m1 value times a power of two: exact in
    bf16 and fp32."""
    d = offs_d[None, :]
    byte = tl.load(row_ptr + d // 2, mask=mask, other=0).to(tl.int32)
    code = (byte >> ((d & 1) * 4)) & 0xF
    e = (code & 7) >> 1
    m = (code & 1).to(tl.float32)
    # magnitude codes 2..7 are (1 + m/2) 2^(e - 1) (2^(e - 1) built from its exponent bits); 1 is 0.5
    mag = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * ((e + 126) << 23).to(tl.float32, bitcast=True))
    val = tl.where((code & 8) != 0, -mag, mag)
    sbyte = tl.load(row_ptr + DI // 2 + d // FP4_BLOCK, mask=mask, other=0).to(tl.int32)
    return val * (sbyte << 23).to(tl.float32, bitcast=True)


# The keys' high halves of -inf and +inf (reference.topk_indices' order-preserving bits):
# a chosen key with either is not a real candidate (the reference's isinf test).
_NEG_INF_ORDERED = tl.constexpr(-2139095041)  # bits 0xFF800000 ^ 0x7FFFFFFF, as int32
_POS_INF_ORDERED = tl.constexpr(2139095040)  # bits 0x7F800000


@triton.jit
def _topk_key(score, cols, C):
    """reference.topk_indices' key of fp32 `score` at column `cols`: the order-preserving
    int32 of the score (-0.0 as +0.0) in the high half, C - 1 - col in the low half."""
    bits = tl.where(score == 0.0, 0.0, score).to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (ordered.to(tl.int64) << 32) | (C - 1 - cols).to(tl.int64)


@triton.jit
def _keys_to_slots_kernel(
    keys_ptr, slots_ptr, rows_ptr, max_col, out_ptr,
    stride_kt, stride_st, stride_ot, C, K, TOPK,
    BLOCK_K: tl.constexpr, PAGED: tl.constexpr, RATIO: tl.constexpr,
):
    """Row t's live chosen keys (of the first K) as slots, packed to the front in the keys'
    order, then -1 up to TOPK: the attention reads a row's first topk_len entries, and an
    unsorted selection may put a masked candidate before a live one. One program per row
    (BLOCK_K >= TOPK)."""
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_K)
    chosen = j < K
    key = tl.load(keys_ptr + t * stride_kt + j, mask=chosen, other=0)
    high = (key >> 32).to(tl.int32)
    live = chosen & (high != _NEG_INF_ORDERED) & (high != _POS_INF_ORDERED)
    col = (C - 1 - (key & 0xFFFFFFFF)).to(tl.int32)
    if PAGED:
        row = slots_ptr + tl.load(rows_ptr + t).to(tl.int64) * stride_st
        slot = load_page_table_slots(row, col, live, max_col, RATIO)
    else:
        slot = tl.load(slots_ptr + t * stride_st + col, mask=live, other=-1)
    live = live & (slot >= 0)  # an unmapped page-table entry counts as masked too
    dest = tl.cumsum(live.to(tl.int32), axis=0) - 1
    n_live = tl.sum(live.to(tl.int32), axis=0)
    tl.store(out_ptr + t * stride_ot + dest, slot, mask=live)
    tl.store(out_ptr + t * stride_ot + j, tl.full([BLOCK_K], -1, tl.int32), mask=(j >= n_live) & (j < TOPK))


def indexer_logits(q_idx, weights, key_pool, cand_slots, cand_len, logits=None, keys: bool = False):
    """logits [T, C] fp32 (see reference.indexer_logits); cand_slots: a [T, C] list or a
    PageTableList of width C. keys=True: the int64 keys of reference.topk_indices instead."""
    T, NH, DI = q_idx.shape
    cands = kernel_list_args(cand_slots, cand_len, T)
    C = cands.width
    assert q_idx.stride(-1) == 1 and key_pool.stride(-1) == 1 and weights.stride(-1) == 1
    fp4_keys = index_key_layout(key_pool, DI) is not None
    assert fp4_keys or key_pool.dtype == q_idx.dtype
    if logits is None:
        logits = torch.empty(T, C, dtype=torch.int64 if keys else torch.float32, device=q_idx.device)
    if T == 0 or C == 0:
        return logits
    block_n = 64
    tiles = 4 if C >= 4 * block_n else 1
    grid = (T, cdiv(C, block_n * tiles))
    _indexer_logits_kernel[grid](
        q_idx, weights, key_pool, cands.table, cands.rows, cands.max_col, cand_len, logits,
        q_idx.stride(0), q_idx.stride(1), weights.stride(0), key_pool.stride(0),
        cands.table.stride(0), logits.stride(0), NH, DI, C,
        TILES_PER_PROG=tiles, BLOCK_H=max(16, next_power_of_2(NH)), BLOCK_N=block_n,
        BLOCK_D=next_power_of_2(DI), DOT_PREC=dot_precision(q_idx.dtype), PAGED=cands.paged,
        RATIO=cands.ratio,
        KEYS=keys, FP4_KEYS=fp4_keys, FP4_BLOCK=FP4_BLOCK, num_warps=4, num_stages=2,
    )
    return logits


def indexer_topk(q_idx, weights, key_pool, cand_slots, cand_len, topk, out_slots):
    """reference.indexer_topk's selection in at most three launches per chunk of tokens: keys,
    torch.topk over them, slots of the chosen keys. The keys hold the score and the candidate
    position, so the selection (ties: the lower position) is the reference's; its order is
    torch.topk's unsorted one (the op promises no order: sorting cost a radix sort as long as
    the selection itself). When every candidate is chosen (k == C) no selection runs."""
    T = q_idx.shape[0]
    C = list_width(cand_slots)
    k = min(topk, C)
    # int64 keys: half the elements of the fp32 logits bound, the same bytes
    chunk = max(1, MAX_LOGITS_ELEMENTS // 2 // max(C, 1))
    block_k = next_power_of_2(max(topk, 1))  # a row per program: its live slots are packed
    assert out_slots.stride(-1) == 1
    # A static Python loop over token chunks: the chunk count depends only on T and C.
    for start in range(0, T, chunk):
        sl = slice(start, min(start + chunk, T))
        if k == 0:
            out_slots[sl].fill_(-1)
            continue
        part, lens = cand_slots[sl], cand_len[sl]
        keys = indexer_logits(q_idx[sl], weights[sl], key_pool, part, lens, keys=True)
        chosen = keys if k == C else keys.topk(k, dim=-1, sorted=False).values
        cands = kernel_list_args(part, lens, sl.stop - sl.start)
        out = out_slots[sl]
        _keys_to_slots_kernel[(sl.stop - sl.start,)](
            chosen, cands.table, cands.rows, cands.max_col, out,
            chosen.stride(0), cands.table.stride(0), out.stride(0), C, k, topk,
            BLOCK_K=block_k, PAGED=cands.paged, RATIO=cands.ratio, num_warps=4,
        )
    return out_slots
