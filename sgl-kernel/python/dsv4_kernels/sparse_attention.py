"""Triton sparse attention with a per-head sink over gathered KV rows (DSV4 attention core).

One shared KV latent (K == V). Heads are the M side of both dots, so a tile of gathered KV
rows is loaded once per head block. An index list is a [T, W] slot tensor or a PageTableList
(the c128 entries: read from the page table, never materialized). For few tokens the key lists are split across programs
(flash-decoding) and a second kernel merges the partial softmax states together with the sink.

With an FP8 KV cache (kv_fp8.py rows) each gathered row is dequantized on load: e4m3 nope
codes times their block's power-of-two scale, rope dims from the row's model-dtype part. The
result is exact in bf16, so the dots see the same keys as the reference's fp32 unpack.

With `out_rope` the output's RoPE is undone in the store (the release rotates the attention
output back by -angle before wo_a): the output is rounded to its dtype first and rotated from
there, so the values are those of a separate inverse-RoPE pass (in fp32 up to the last bit,
which the compiler's FMA contraction places), one launch fewer per layer.
With `keep_rows` (a decode step) the staging rows of list a's pool move into the window rings in
the same launch (window_ring.py's move): each token's target ring row holds a position that has
left its window, and no other token reads that request's ring.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import pdl
from ._dot import dot_precision
from ._page_table import load_page_table_slots
from .host_math import cdiv, next_power_of_2, sm_count
from .kv_fp8 import KV_FP8_BLOCK
from .page_table_list import kernel_list_args
from .reference import check_kv_layout
from .tile_tables import CONFIGS, load_tiers

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class SparseAttnConfig:
    # Chosen without a GPU from sm_90 compile reports (no spills, 225 registers, two programs
    # per token at H=64); sgl-kernel/benchmark/bench_sparse_attention.py sweeps the alternatives.
    block_h: int = 32
    block_n: int = 32
    num_warps: int = 8
    num_stages: int = 2
    num_splits: int = 0  # 0: chosen from the grid size (see pick_num_splits)
    keys_as_m: bool = False  # QK^T computed as (K Q^T)^T, see _attend_list


MAX_SPLITS = 16


# Launched eagerly (a breakable graph's break, an eager forward), a split covers at least this
# many key blocks of the lists' widths: a shorter split saves less GPU time than its merge
# launch and partial buffers cost on the host, paid by a break on every replay (dsv4-mini's
# 128-key window list at 16 tokens, split 8 ways: 76.5 against 47.4 host µs unsplit,
# benchmark/bcg/bench_launch_overhead.py). Captured into a graph, a split costs no host time at
# replay, so there only the wave decides (decode graphs: Flash's T=1 step split 16 ways).
MIN_BLOCKS_PER_SPLIT = 4


def pick_num_splits(num_programs: int, num_sms: int, width: int | None = None, block_n: int = 32) -> int:
    """Split the key lists only while the grid is under one wave: at the default config one
    program fills an SM's registers, and splitting costs an fp32 partial round trip. `width`
    (the summed list widths of an eager launch) caps the splits at MIN_BLOCKS_PER_SPLIT blocks
    each."""
    cap = MAX_SPLITS if width is None else min(MAX_SPLITS, max(1, width // (MIN_BLOCKS_PER_SPLIT * block_n)))
    splits = 1
    while splits * 2 <= cap and num_programs * splits * 2 <= num_sms:
        splits *= 2
    return splits


@triton.jit
def _load_keys(kv_ptr, stride_kv, rope_ptr, stride_rope, slot, valid, offs_d, d_mask, nope_dim,
               scale_offset, KV_FP8: tl.constexpr, FP8_BLOCK: tl.constexpr, DEQ_BF16: tl.constexpr):
    """The gathered rows [BLOCK_N, BLOCK_D]: as stored, or FP8 rows dequantized (to bf16 with
    DEQ_BF16, exact: an e4m3 value times a power of two; that halves the registers of the
    dequantized tile against fp32; else to fp32)."""
    slot = slot.to(tl.int64)
    if KV_FP8:
        rows = kv_ptr + slot[:, None] * stride_kv
        nope = offs_d < nope_dim
        nmask = valid[:, None] & nope[None, :]
        codes = tl.load(rows + offs_d[None, :], mask=nmask, other=0)
        sbyte = tl.load(rows + scale_offset + offs_d[None, :] // FP8_BLOCK, mask=nmask, other=127)
        rmask = valid[:, None] & ((offs_d >= nope_dim) & d_mask)[None, :]
        k_rope = tl.load(rope_ptr + slot[:, None] * stride_rope + (offs_d - nope_dim)[None, :],
                         mask=rmask, other=0.0)
        # (one return per function: Triton refuses returns of different types, even in
        # branches a constexpr prunes)
        if DEQ_BF16:  # the power-of-two scale is exact in bf16
            scale = (sbyte.to(tl.int32) << 23).to(tl.float32, bitcast=True).to(tl.bfloat16)
            k_nope = codes.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16) * scale
            k = tl.where(nope[None, :], k_nope, k_rope.to(tl.bfloat16))
        else:
            scale = (sbyte.to(tl.int32) << 23).to(tl.float32, bitcast=True)
            k_nope = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale
            k = tl.where(nope[None, :], k_nope, k_rope.to(tl.float32))
    else:
        k = tl.load(kv_ptr + slot[:, None] * stride_kv + offs_d[None, :],
                    mask=valid[:, None] & d_mask[None, :], other=0.0)
    return k


@triton.jit
def _attend_list(q, m_i, l_i, acc, kv_ptr, stride_kv, rope_ptr, stride_rope, idx_row_ptr, length,
                 split, qk_scale, offs_d, d_mask, nope_dim, scale_offset, max_col,
                 NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
                 KEYS_AS_M: tl.constexpr, KV_FP8: tl.constexpr, FP8_BLOCK: tl.constexpr,
                 DEQ_BF16: tl.constexpr, PAGED: tl.constexpr, RATIO: tl.constexpr):
    """Online softmax over this split's share of one index list (the first `length` entries).
    PAGED: idx_row_ptr is the token's page-table row, entries read as PageTableList's."""
    chunk = tl.cdiv(tl.cdiv(length, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, length)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        if PAGED:
            slot = load_page_table_slots(idx_row_ptr, offs_n, offs_n < end, max_col, RATIO)
        else:
            slot = tl.load(idx_row_ptr + offs_n, mask=offs_n < end, other=-1)
        valid = slot >= 0
        k = _load_keys(kv_ptr, stride_kv, rope_ptr, stride_rope, slot, valid, offs_d, d_mask,
                       nope_dim, scale_offset, KV_FP8, FP8_BLOCK, DEQ_BF16).to(q.dtype)
        if KEYS_AS_M:
            # Keys as the M side: q^T becomes the B operand, which Hopper's wgmma reads from
            # shared memory, so the [heads, D] q tile does not occupy registers.
            s = tl.trans(tl.dot(k, tl.trans(q), input_precision=DOT_PREC)) * qk_scale
        else:
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype), k, input_precision=DOT_PREC)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _inverse_rope_tile(o, d0, pos, cos_ptr, sin_ptr, stride_cs, stride_cs_k, D, rope_dim,
                       BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """The output tile o [BLOCK_H, BLOCK_D] (dims d0.., in the output dtype) rotated by -angle at
    `pos` on the row's last rope_dim dims (GPT-J pairs 2k, 2k + 1), the same arithmetic as
    cache_write's inverse RoPE; returned in o's dtype. d0 is even, so a tile holds whole pairs."""
    x0, x1 = tl.split(tl.reshape(o.to(tl.float32), [BLOCK_H, BLOCK_D // 2, 2]))
    k = d0 // 2 + tl.arange(0, BLOCK_D // 2)  # the row's pair index
    first_rope_pair = (D - rope_dim) // 2
    rope_mask = (k >= first_rope_pair) & (k < D // 2)
    cs_off = pos * stride_cs + tl.maximum(k - first_rope_pair, 0) * stride_cs_k
    c = tl.load(cos_ptr + cs_off, mask=rope_mask, other=1.0).to(tl.float32)[None, :]
    s = -tl.load(sin_ptr + cs_off, mask=rope_mask, other=0.0).to(tl.float32)[None, :]
    y0 = x0 * c - x1 * s
    y1 = x0 * s + x1 * c
    return tl.reshape(tl.join(y0, y1), [BLOCK_H, BLOCK_D]).to(o.dtype)


@triton.jit
def _sparse_attn_kernel(
    q_ptr, kv_a_ptr, idx_a_ptr, len_a_ptr, kv_b_ptr, idx_b_ptr, len_b_ptr, sink_ptr,
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    rope_a_ptr, stride_rope_a, rope_b_ptr, stride_rope_b, nope_dim, scale_offset,
    qk_scale, H, D, WA, WB, rows_a_ptr, rows_b_ptr, max_col_a, max_col_b,
    stride_qt, stride_qh, stride_kva, stride_ia, stride_kvb, stride_ib, stride_ot, stride_oh,
    cos_ptr, sin_ptr, stride_cs, stride_cs_k, pos_ptr, rope_dim, keep_ptr, keep_n, staging_start, row_width,
    HAS_B: tl.constexpr, NUM_SPLITS: tl.constexpr, OUT_ROPE: tl.constexpr, KEEP_ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr,
    KEYS_AS_M: tl.constexpr, KV_FP8: tl.constexpr, FP8_BLOCK: tl.constexpr, DEQ_BF16: tl.constexpr,
    PAGED_A: tl.constexpr, RATIO_A: tl.constexpr, PAGED_B: tl.constexpr, RATIO_B: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    # A list is a [T, W] slot tensor (row t at idx + t * stride), or with PAGED_* a page table
    # (idx = rtt, stride its row stride) read at each token's row rows[t] (PageTableList).
    # Axis 0 is (token, head block) with the head block fastest, so the programs of one token
    # run together and share the gathered rows through L2 (and T is not capped at 65535).
    pid = tl.program_id(0)
    num_hb = tl.cdiv(H, BLOCK_H)
    pid_h = pid % num_hb
    t = (pid // num_hb).to(tl.int64)
    split = tl.program_id(1)

    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    q = tl.load(q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)

    if NUM_SPLITS == 1:
        # The sink enters as the starting state: max = sink, denominator = exp(sink - sink).
        m_i = tl.load(sink_ptr + offs_h, mask=h_mask, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_H], 1.0, tl.float32)
    else:
        # A finite stand-in for -inf as the running max: exp2(max - new_max) is 0, never NaN.
        m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)

    # A length past the list width (a caller bug) is clamped rather than read out of bounds.
    len_a = tl.minimum(tl.load(len_a_ptr + t), WA)
    if PAGED_A:
        row_a = idx_a_ptr + tl.load(rows_a_ptr + t).to(tl.int64) * stride_ia
    else:
        row_a = idx_a_ptr + t * stride_ia
    m_i, l_i, acc = _attend_list(q, m_i, l_i, acc, kv_a_ptr, stride_kva, rope_a_ptr, stride_rope_a,
                                 row_a, len_a, split, qk_scale, offs_d, d_mask,
                                 nope_dim, scale_offset, max_col_a,
                                 NUM_SPLITS, BLOCK_N, DOT_PREC, KEYS_AS_M, KV_FP8, FP8_BLOCK, DEQ_BF16,
                                 PAGED_A, RATIO_A)
    if HAS_B:
        len_b = tl.minimum(tl.load(len_b_ptr + t), WB)
        if PAGED_B:
            row_b = idx_b_ptr + tl.load(rows_b_ptr + t).to(tl.int64) * stride_ib
        else:
            row_b = idx_b_ptr + t * stride_ib
        m_i, l_i, acc = _attend_list(q, m_i, l_i, acc, kv_b_ptr, stride_kvb, rope_b_ptr, stride_rope_b,
                                     row_b, len_b, split, qk_scale, offs_d, d_mask,
                                     nope_dim, scale_offset, max_col_b,
                                     NUM_SPLITS, BLOCK_N, DOT_PREC, KEYS_AS_M, KV_FP8, FP8_BLOCK, DEQ_BF16,
                                     PAGED_B, RATIO_B)

    if KEEP_ROWS:  # one program of the token moves its staging row (whole, any row format)
        if (pid_h == 0) & (split == 0) & (t < keep_n):
            dst = tl.load(keep_ptr + t).to(tl.int64)
            for c0 in range(0, row_width, BLOCK_D):
                cols = c0 + tl.arange(0, BLOCK_D)
                live = cols < row_width
                row = tl.load(kv_a_ptr + (staging_start + t) * stride_kva + cols, mask=live)
                tl.store(kv_a_ptr + dst * stride_kva + cols, row, mask=live)

    hd_mask = h_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        o = (acc / l_i[:, None]).to(out_ptr.dtype.element_ty)
        if OUT_ROPE:
            o = _inverse_rope_tile(o, 0, tl.load(pos_ptr + t).to(tl.int64), cos_ptr, sin_ptr, stride_cs,
                                   stride_cs_k, D, rope_dim, BLOCK_H, BLOCK_D)
        tl.store(out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :], o, mask=hd_mask)
    else:
        row = (t * NUM_SPLITS + split) * H + offs_h  # partials are [T, S, H(, D)]
        tl.store(part_m_ptr + row, m_i, mask=h_mask)
        tl.store(part_l_ptr + row, l_i, mask=h_mask)
        tl.store(part_acc_ptr + row[:, None] * D + offs_d[None, :], acc, mask=hd_mask)


@triton.jit
def _merge_splits_kernel(
    part_acc_ptr, part_m_ptr, part_l_ptr, sink_ptr, out_ptr, H, D, stride_ot, stride_oh,
    cos_ptr, sin_ptr, stride_cs, stride_cs_k, pos_ptr, rope_dim,
    NUM_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, OUT_ROPE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    pid = tl.program_id(0)
    num_hb = tl.cdiv(H, BLOCK_H)
    pid_h = pid % num_hb
    t = (pid // num_hb).to(tl.int64)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # a chunk of D: few registers
    hd_mask = h_mask[:, None] & (offs_d < D)[None, :]

    sink2 = tl.load(sink_ptr + offs_h, mask=h_mask, other=0.0).to(tl.float32) * 1.4426950408889634
    m = sink2
    for s in range(NUM_SPLITS):  # not unrolled: 16 unrolled splits spill
        m = tl.maximum(m, tl.load(part_m_ptr + (t * NUM_SPLITS + s) * H + offs_h, mask=h_mask,
                                  other=-1.0e30))
    l_sum = tl.exp2(sink2 - m)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for s in range(NUM_SPLITS):  # not unrolled: 16 unrolled splits spill
        row = (t * NUM_SPLITS + s) * H + offs_h
        w = tl.exp2(tl.load(part_m_ptr + row, mask=h_mask, other=-1.0e30) - m)
        l_sum += w * tl.load(part_l_ptr + row, mask=h_mask, other=0.0)
        acc += w[:, None] * tl.load(part_acc_ptr + row[:, None] * D + offs_d[None, :],
                                    mask=hd_mask, other=0.0)
    o = (acc / l_sum[:, None]).to(out_ptr.dtype.element_ty)
    if OUT_ROPE:
        o = _inverse_rope_tile(o, tl.program_id(1) * BLOCK_D, tl.load(pos_ptr + t).to(tl.int64), cos_ptr, sin_ptr,
                               stride_cs, stride_cs_k, D, rope_dim, BLOCK_H, BLOCK_D)
    tl.store(out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :], o, mask=hd_mask)


def measured_config(num_tokens: int, kv_fp8: bool = False) -> SparseAttnConfig:
    """The configuration of the first tier of configs/sparse_attention_tiles.json (TILES_FILE,
    read at import) holding num_tokens: the best ones measured at dsv4-flash-slice decode
    shapes (H=64, D=512, 128 window + 512 c4 entries; sgl-kernel/benchmark/
    bench_sparse_attention.py sweeps them) on the device the file names. There: 32-head blocks
    with split key lists for a handful of tokens, 64-head blocks above, keys on the M side
    once there are enough tokens to fill the machine. kv_fp8: the tier's `kv_fp8_tiles` (the
    in-kernel dequantization of FP8 rows needs registers of its own: sm_90 compile reports,
    sgl-kernel/benchmark/sm90_resources.py, show 32-head blocks spilling 512 bytes per thread
    with FP8 KV, 16-head blocks 40)."""
    for bound, config, fp8_config in _TIERS:
        if bound is None or num_tokens <= bound:
            return fp8_config if kv_fp8 else config
    raise AssertionError("load_tiers guarantees an unbounded last tier")


TILES_FILE = CONFIGS / "sparse_attention_tiles.json"
# built once: a break calls measured_config on every replay
_TIERS = tuple((bound, SparseAttnConfig(**tiles), SparseAttnConfig(**fp8_tiles))
               for bound, tiles, fp8_tiles in load_tiers(TILES_FILE, "max_tokens", "kv_fp8_tiles"))


def sparse_attn_with_sink(q, kv_a, idx_a, len_a, kv_b, idx_b, len_b, sink, scale, out,
                          config: SparseAttnConfig | None = None, kv_layout=None, out_rope=None, keep_rows=None):
    """idx_a / idx_b: [T, W] slot lists or PageTableLists (width W, read from the page
    table). kv_layout (kv_fp8.FP8KVLayout): kv_a / kv_b are uint8 FP8 KV rows of that layout.
    out_rope (cos, sin, positions, rope_dim): the stores undo that RoPE; keep_rows
    (staging_start, keep_loc): keep_window_rows_ on kv_a in the same launch (see the module doc)."""
    T, H, D = q.shape
    config = config or measured_config(T, kv_fp8=kv_layout is not None)
    check_kv_layout(kv_a, kv_layout, "sparse_attn_with_sink kv_a")
    if kv_b is not None:
        check_kv_layout(kv_b, kv_layout, "sparse_attn_with_sink kv_b")
    fp8 = kv_layout is not None
    assert q.stride(-1) == 1 and kv_a.stride(-1) == 1 and out.stride(-1) == 1
    list_a = kernel_list_args(idx_a, len_a, T)
    assert fp8 or kv_a.dtype == q.dtype
    assert not fp8 or kv_layout.head_dim == D
    if T == 0:
        return out
    has_b = kv_b is not None
    if has_b:
        assert kv_b.stride(-1) == 1 and (fp8 or kv_b.dtype == q.dtype)
        list_b = kernel_list_args(idx_b, len_b, T)
    else:
        kv_b, len_b, list_b = kv_a, len_a, list_a  # never read
    # FP8 rows: the rope parts as views in the rope dtype (never read for float pools)
    rope_a = kv_layout.rope(kv_a) if fp8 else kv_a
    rope_b = kv_layout.rope(kv_b) if fp8 else kv_b

    block_h = max(16, min(config.block_h, next_power_of_2(H)))
    block_d = next_power_of_2(D)
    num_hb = cdiv(H, block_h)
    splits = config.num_splits
    if not splits:  # captured into a graph, only the wave decides (see MIN_BLOCKS_PER_SPLIT)
        capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
        width = None if capturing else list_a.width + (list_b.width if has_b else 0)
        splits = pick_num_splits(T * num_hb, sm_count(q.device), width, config.block_n)
    if splits > 1:
        part_acc = torch.empty(T, splits, H, D, dtype=torch.float32, device=q.device)
        part_m = torch.empty(T, splits, H, dtype=torch.float32, device=q.device)
        part_l = torch.empty(T, splits, H, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_m = part_l = out  # never read
    if out_rope is not None:
        cos, sin, positions, rope_dim = out_rope
        assert cos.stride() == sin.stride() and positions.shape[0] >= T and rope_dim % 2 == 0 and rope_dim <= D
        rope_args = (cos, sin, cos.stride(0), cos.stride(1), positions, rope_dim)
    else:
        rope_args = (q, q, 0, 0, len_a, 0)  # never read
    if keep_rows is not None:
        staging_start, keep_loc = keep_rows
        assert keep_loc.shape[0] <= T and kv_a.stride(1) == 1
        keep_args = (keep_loc, keep_loc.shape[0], staging_start, kv_a.shape[1])
    else:
        keep_args = (len_a, 0, 0, 0)  # never read

    _sparse_attn_kernel[(T * num_hb, splits)](
        q, kv_a, list_a.table, len_a, kv_b, list_b.table, len_b, sink, out, part_acc, part_m, part_l,
        rope_a, rope_a.stride(0), rope_b, rope_b.stride(0),
        kv_layout.nope_dim if fp8 else D, kv_layout.scale_offset if fp8 else 0,
        float(scale) * LOG2E, H, D, list_a.width, list_b.width, list_a.rows, list_b.rows,
        list_a.max_col, list_b.max_col,
        q.stride(0), q.stride(1), kv_a.stride(0), list_a.table.stride(0), kv_b.stride(0), list_b.table.stride(0),
        out.stride(0), out.stride(1), *rope_args, *keep_args,
        HAS_B=has_b, NUM_SPLITS=splits, OUT_ROPE=out_rope is not None, KEEP_ROWS=keep_rows is not None,
        BLOCK_H=block_h, BLOCK_N=config.block_n,
        BLOCK_D=block_d, DOT_PREC=dot_precision(q.dtype), KEYS_AS_M=config.keys_as_m,
        KV_FP8=fp8, FP8_BLOCK=KV_FP8_BLOCK, DEQ_BF16=q.dtype == torch.bfloat16,
        PAGED_A=list_a.paged, RATIO_A=list_a.ratio, PAGED_B=list_b.paged, RATIO_B=list_b.ratio,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl.options(q))
    if splits > 1:
        # Few tokens (decode): small tiles, so that enough programs stream the partials (16 x 128
        # tiles gave a one-token Flash step 16 programs, ~10 µs per layer on an H200). Each
        # output element's merge is the same sum in the same order whatever the tile.
        merge_h, merge_d = (16, min(block_d, 128)) if T * cdiv(H, 16) >= sm_count(q.device) else (4, min(block_d, 64))
        _merge_splits_kernel[(T * cdiv(H, merge_h), cdiv(D, merge_d))](
            part_acc, part_m, part_l, sink, out, H, D, out.stride(0), out.stride(1), *rope_args,
            NUM_SPLITS=splits, BLOCK_H=merge_h, BLOCK_D=merge_d, OUT_ROPE=out_rope is not None, num_warps=4,
            **pdl.options(part_acc))
    return out
