"""Triton logits of the c4 sparse indexer, followed by a top-k selection of slots.

I(t, j) = sum_h w[t,h] * relu(q[t,h] . K[cand(t, j)]). The candidates are a [T, C] slot list,
or (the runtime's case) a PageTableList read straight from the page table, so no [T, C]
list exists. Heads are the M side of the dot so a tile of gathered keys is read once per
token. Masked candidates get -inf and never win. Keys are float rows in q's dtype or packed
FP4 rows (index_key_fp4.py, release numerics), decoded exactly to q's dtype as a tile is
gathered: the same dot as float keys holding those values, so the same logits bit for bit.

`indexer_topk` runs the logits kernel, whose tiles past a row's candidate count skip the dot,
then one of two selections (ties to the lower candidate position, as in the reference):
- lists up to SELECT_MAX_WIDTH wide: the logits kernel writes each score's order-preserving
  int32 (the high half of reference.topk_indices' key) and the select kernel takes each row's
  best k by a radix select over those bits, reading only the row's live candidates. A row
  with at most k of them needs no selection at all, which a static-shape torch.topk over the
  captured width could not skip (36 us per c4 layer at decode over 2048 columns);
- wider lists: the int64 keys of reference.topk_indices (the bits, then the reversed column),
  an unsorted torch.topk over them and a kernel that turns the chosen keys into slots.
"""

import torch
import triton
import triton.language as tl

from . import pdl
from ._dot import dot_precision
from ._page_table import load_page_table_slots
from .host_math import cdiv, next_power_of_2
from .page_table_list import kernel_list_args, list_width
from .quant_reference import FP4_BLOCK
from .reference import index_key_layout

# Bound on the fp32 logits scratch (elements); longer batches are scored in token chunks.
MAX_LOGITS_ELEMENTS = 1 << 26
# Candidates per step of the select kernel's passes.
SELECT_BLOCK = 1024
# Widest candidate lists the select kernel takes. One program per row walks a row up to five
# times, so past a few thousand live candidates torch.topk's selection (multi-block, int64
# keys) is faster: on an H200 (bench_indexer.py, graph replay) the select kernel took 6.1 us
# where torch.topk took 36 for a decode row of 256 live candidates in a 2048 width, 23.2 vs
# 19.3 us at 2048 live, but 244 vs 49 at 32768 and 129 vs 93 for 1024 rows of 4096.
SELECT_MAX_WIDTH = 2048


@triton.jit
def _indexer_logits_kernel(
    q_ptr, w_ptr, key_ptr, slots_ptr, rows_ptr, max_col, len_ptr, logits_ptr,
    stride_qt, stride_qh, stride_wt, stride_key, stride_st, stride_lt,
    NH, DI, C,
    TILES_PER_PROG: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr, PAGED: tl.constexpr, RATIO: tl.constexpr,
    OUT: tl.constexpr, FP4_KEYS: tl.constexpr, FP4_BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """PAGED: slots_ptr is the page table (row stride stride_st) and rows_ptr each token's row;
    else slots_ptr is the [T, C] list. OUT: what is stored per candidate: 0 the fp32 logit,
    1 its order-preserving int32 (_ordered_bits), 2 the int64 top-k key (_topk_key). FP4_KEYS: key rows are packed FP4 bytes (index_key_fp4.py),
    decoded to q's dtype (exact). A tile wholly past the row's length stores -inf unread."""
    pdl.enter(PDL)
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
        tile = (tl.program_id(1) * TILES_PER_PROG + i) * BLOCK_N
        offs_n = tile + tl.arange(0, BLOCK_N)
        score = tl.full([BLOCK_N], float("-inf"), tl.float32)
        if tile < length:
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
            score = tl.where(valid, tl.sum(dots * w[:, None], 0), float("-inf"))
        if OUT == 1:
            tl.store(logits_ptr + t * stride_lt + offs_n, _ordered_bits(score), mask=offs_n < C)
        elif OUT == 2:
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


# The order-preserving int32 of -inf and +inf: a candidate with either is not a real one
# (the reference's isinf test).
_NEG_INF_ORDERED = tl.constexpr(-2139095041)  # bits 0xFF800000 ^ 0x7FFFFFFF, as int32
_POS_INF_ORDERED = tl.constexpr(2139095040)  # bits 0x7F800000


@triton.jit
def _ordered_bits(score):
    """The int32 whose signed order is fp32 `score`'s order (-0.0 as +0.0): the high half of
    reference.topk_indices' key."""
    bits = tl.where(score == 0.0, 0.0, score).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _topk_key(score, cols, C):
    """reference.topk_indices' int64 key of fp32 `score` at column `cols`: the ordered bits in
    the high half, C - 1 - col in the low half."""
    return (_ordered_bits(score).to(tl.int64) << 32) | (C - 1 - cols).to(tl.int64)


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



@triton.jit
def _live_keys(key_row, c, length):
    """Which of columns c are live candidates (inside the row's length, a finite score), and
    their keys as u = ordered + 2**31: unsigned order in an int64."""
    key = tl.load(key_row + c, mask=c < length, other=_NEG_INF_ORDERED)
    live = (c < length) & (key != _NEG_INF_ORDERED) & (key != _POS_INF_ORDERED)
    return live, key.to(tl.int64) + 2147483648


@triton.jit
def _select_topk_kernel(
    keys_ptr, len_ptr, slots_ptr, rows_ptr, max_col, out_ptr,
    stride_kt, stride_st, stride_ot, K, TOPK,
    BLOCK: tl.constexpr, PAGED: tl.constexpr, RATIO: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Row t's best K live candidates among its first len[t] (by ordered key descending, ties
    by the lower column), as slots in column order, then -1 up to TOPK. One program per row.

    Radix select over u = key + 2**31 (unsigned order) a byte at a time from the top: a
    masked histogram of the byte among the candidates that match the bytes fixed so far gives
    the K-th best's byte. After four bytes u_K is known exactly, with `need` = how many of the
    candidates equal to it are taken (the first ones by column). A row with at most K live
    candidates skips the three lower bytes and takes them all."""
    pdl.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    length = tl.load(len_ptr + t)
    key_row = keys_ptr + t * stride_kt
    cols = tl.arange(0, BLOCK)
    bins = tl.arange(0, 256)

    # Byte 3 (the top one) over every live candidate; its total is the live count.
    hist = tl.zeros([256], tl.int32)
    for start in range(0, length, BLOCK):
        c = start + cols
        live, u = _live_keys(key_row, c, length)
        hist += tl.histogram((u >> 24).to(tl.int32), 256, mask=live)
    n_live = tl.sum(hist, 0)
    threshold = tl.zeros([], tl.int64)  # u of the K-th best; 0 when all are taken (every live u >= 0)
    need = n_live  # ties at the threshold to take; when all are taken: all of them
    if n_live > K:
        remaining = K
        prefix = tl.zeros([], tl.int64)
        for b in tl.static_range(4):  # byte 3 - b, at bit 24 - 8 b
            if b > 0:
                hist = tl.zeros([256], tl.int32)
                for start in range(0, length, BLOCK):
                    c = start + cols
                    live, u = _live_keys(key_row, c, length)
                    match = live & ((u >> (32 - 8 * b)) == prefix)
                    hist += tl.histogram(((u >> (24 - 8 * b)) & 255).to(tl.int32), 256, mask=match)
            # at_least[d]: candidates of this prefix whose byte is >= d
            at_least = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist
            byte = tl.max(tl.where(at_least >= remaining, bins, -1), 0)
            remaining -= tl.sum(tl.where(bins > byte, hist, 0), 0)
            prefix = prefix * 256 + byte
        threshold = prefix
        need = remaining

    # Write the chosen slots in column order.
    row = slots_ptr + (tl.load(rows_ptr + t).to(tl.int64) * stride_st if PAGED else t * stride_st)
    out_row = out_ptr + t * stride_ot
    written = tl.zeros([], tl.int32)
    ties = tl.zeros([], tl.int32)
    for start in range(0, length, BLOCK):
        c = start + cols
        live, u = _live_keys(key_row, c, length)
        tie = live & (u == threshold)
        tie_rank = ties + tl.cumsum(tie.to(tl.int32), 0) - 1
        chosen = live & ((u > threshold) | (tie & (tie_rank < need)))
        if PAGED:
            slot = load_page_table_slots(row, c, chosen, max_col, RATIO)
        else:
            slot = tl.load(row + c, mask=chosen, other=-1)
        dest = written + tl.cumsum(chosen.to(tl.int32), 0) - 1
        tl.store(out_row + dest, slot, mask=chosen)
        written += tl.sum(chosen.to(tl.int32), 0)
        ties += tl.sum(tie.to(tl.int32), 0)
    for start in range(written, TOPK, BLOCK):
        j = start + cols
        tl.store(out_row + j, tl.full([BLOCK], -1, tl.int32), mask=j < TOPK)


def indexer_logits(q_idx, weights, key_pool, cand_slots, cand_len, logits=None, out: str = "logits"):
    """logits [T, C] fp32 (see reference.indexer_logits); cand_slots: a [T, C] list or a
    PageTableList of width C. out="ordered": each score's order-preserving int32 instead;
    out="keys": reference.topk_indices' int64 keys (the score's bits, then the reversed column)."""
    mode = ("logits", "ordered", "keys").index(out)
    T, NH, DI = q_idx.shape
    cands = kernel_list_args(cand_slots, cand_len, T)
    C = cands.width
    assert q_idx.stride(-1) == 1 and key_pool.stride(-1) == 1 and weights.stride(-1) == 1
    fp4_keys = index_key_layout(key_pool, DI) is not None
    assert fp4_keys or key_pool.dtype == q_idx.dtype
    if logits is None:
        logits = torch.empty(T, C, dtype=(torch.float32, torch.int32, torch.int64)[mode], device=q_idx.device)
    if T == 0 or C == 0:
        return logits
    block_n = 64
    # Four tiles a program read q once for 256 candidates; with few programs (decode) one
    # tile each spreads a row over more SMs.
    tiles = 4 if T * cdiv(C, block_n) >= 2048 else 1
    grid = (T, cdiv(C, block_n * tiles))
    _indexer_logits_kernel[grid](
        q_idx, weights, key_pool, cands.table, cands.rows, cands.max_col, cand_len, logits,
        q_idx.stride(0), q_idx.stride(1), weights.stride(0), key_pool.stride(0),
        cands.table.stride(0), logits.stride(0), NH, DI, C,
        TILES_PER_PROG=tiles, BLOCK_H=max(16, next_power_of_2(NH)), BLOCK_N=block_n,
        BLOCK_D=next_power_of_2(DI), DOT_PREC=dot_precision(q_idx.dtype), PAGED=cands.paged,
        RATIO=cands.ratio,
        OUT=mode, FP4_KEYS=fp4_keys, FP4_BLOCK=FP4_BLOCK, num_warps=4, num_stages=2, **pdl.options(q_idx))
    return logits


def select_topk_slots(ordered, cand_slots, cand_len, topk, out_slots):
    """out_slots [T, topk] = slots of each row's best min(topk, live) candidates among its
    first cand_len (reference.select_topk_slots' selection; ties: the lower position), in
    candidate order, then -1. ordered: [T, C] int32 order-preserving score bits (the logits
    kernel's out="ordered"), -inf for masked candidates."""
    T, C = ordered.shape
    assert ordered.dtype == torch.int32 and out_slots.stride(-1) == 1
    if T == 0:
        return out_slots
    cands = kernel_list_args(cand_slots, cand_len, T)
    _select_topk_kernel[(T,)](
        ordered, cand_len, cands.table, cands.rows, cands.max_col, out_slots,
        ordered.stride(0), cands.table.stride(0), out_slots.stride(0), min(topk, C), topk,
        BLOCK=SELECT_BLOCK, PAGED=cands.paged, RATIO=cands.ratio, num_warps=4, **pdl.options(ordered))
    return out_slots


def topk_slots_by_keys(keys, cand_slots, cand_len, topk, out_slots):
    """select_topk_slots' selection from int64 top-k keys (out="keys"): an unsorted torch.topk
    over the whole width, then a kernel that turns the chosen keys into slots, the live ones
    packed first (in torch.topk's order). The wide rows' path: see SELECT_MAX_WIDTH."""
    T, C = keys.shape
    k = min(topk, C)
    if T == 0:
        return out_slots
    if k == 0:
        return out_slots.fill_(-1)
    chosen = keys if k == C else keys.topk(k, dim=-1, sorted=False).values
    cands = kernel_list_args(cand_slots, cand_len, T)
    _keys_to_slots_kernel[(T,)](
        chosen, cands.table, cands.rows, cands.max_col, out_slots,
        chosen.stride(0), cands.table.stride(0), out_slots.stride(0), C, k, topk,
        BLOCK_K=next_power_of_2(max(topk, 1)), PAGED=cands.paged, RATIO=cands.ratio, num_warps=4,
    )
    return out_slots


def indexer_topk(q_idx, weights, key_pool, cand_slots, cand_len, topk, out_slots):
    """reference.indexer_topk's selection (ties: the lower candidate position) in two or three
    launches per chunk of tokens: scores, then the select kernel up to SELECT_MAX_WIDTH
    candidates a row, beyond it int64 keys, torch.topk and the slot kernel. The op promises the
    reference's selection, not its order: chosen slots first, then -1."""
    T = q_idx.shape[0]
    C = list_width(cand_slots)
    wide = C > SELECT_MAX_WIDTH
    # int64 keys on the wide path: half the elements of the fp32 logits bound, the same bytes
    chunk = max(1, MAX_LOGITS_ELEMENTS // (2 if wide else 1) // max(C, 1))
    # A static Python loop over token chunks: the chunk count depends only on T and C.
    for start in range(0, T, chunk):
        sl = slice(start, min(start + chunk, T))
        part, lens = cand_slots[sl], cand_len[sl]
        if wide:
            keys = indexer_logits(q_idx[sl], weights[sl], key_pool, part, lens, out="keys")
            topk_slots_by_keys(keys, part, lens, topk, out_slots[sl])
        else:
            ordered = indexer_logits(q_idx[sl], weights[sl], key_pool, part, lens, out="ordered")
            select_topk_slots(ordered, part, lens, topk, out_slots[sl])
    return out_slots
