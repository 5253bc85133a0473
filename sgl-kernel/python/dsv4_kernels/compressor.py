"""Triton kernels of the KV compressor: per-channel softmax pooling of an emission's rows, and
the per-request ring-state update. Norm + RoPE + store of the pooled entry reuses cache_write.

`compressor_emit` does all of it in one launch: each program pools one emission (every
channel), normalises, rotates and stores it, and, when the caller says no emission reads a ring
row this step writes (a decode step: one token per request), writes one token's ring rows too.
The model runs it at ratio 4 only: at ratio 128 one program pooling 128 rows of every channel
took 44.8 us at decode on an H200, the separate pool / update / norm launches 7 us.
"""

import torch
import triton
import triton.language as tl

from . import pdl, reference
from .cache_write import (INV_E4M3_MAX, norm_rope_store_row, pool_layout, rmsnorm_rope_store,
                          store_row_constexprs)
from .host_math import cdiv, next_power_of_2
from .quant_reference import AMAX_FLOOR


@triton.jit
def _pool_tile(kv_state_ptr, score_state_ptr, kv_new_ptr, score_new_ptr, idx, c, c_mask, ape_ptr, pos_ptr,
               stride_state, stride_new, stride_ape, D, RATIO: tl.constexpr, COFF: tl.constexpr,
               HAS_APE: tl.constexpr):
    """The pooled values of channels c (fp32) of the emission whose source rows are idx."""
    rows = tl.arange(0, RATIO * COFF)
    from_state = idx >= 0
    from_new = idx <= -2
    # Ratio 4 overlaps blocks: its first RATIO rows (block i-1) read channel half [0:D], the
    # last RATIO rows (block i) half [D:2D]. Ratio 128 has one half.
    ch = (rows // RATIO)[:, None] * D + c[None, :]
    state_off = tl.maximum(idx, 0)[:, None] * stride_state + ch
    new_off = tl.maximum(-idx - 2, 0)[:, None] * stride_new + ch
    m_state = from_state[:, None] & c_mask[None, :]
    m_new = from_new[:, None] & c_mask[None, :]

    kv = tl.load(kv_state_ptr + state_off, mask=m_state, other=0.0) + \
        tl.load(kv_new_ptr + new_off, mask=m_new, other=0.0)
    fresh = tl.load(score_new_ptr + new_off, mask=m_new, other=float("-inf"))
    if HAS_APE:  # a fresh row's score gets its position's ape row here (the ring holds it added)
        pos = tl.load(pos_ptr + tl.maximum(-idx - 2, 0), mask=from_new, other=0)
        fresh += tl.load(ape_ptr + (pos % RATIO)[:, None] * stride_ape + ch, mask=m_new, other=0.0)
    score = tl.where(from_state[:, None],
                     tl.load(score_state_ptr + state_off, mask=m_state, other=float("-inf")), fresh)
    m = tl.max(score, 0)
    # All rows empty (a padding emission): pool to 0, not NaN.
    m = tl.where(m == float("-inf"), 0.0, m)
    p = tl.exp(score - m[None, :])
    denom = tl.sum(p, 0)
    return tl.sum(p * kv, 0) / tl.where(denom > 0, denom, 1.0)


@triton.jit
def _ring_row_store(kv_state_ptr, score_state_ptr, kv_new_ptr, score_new_ptr, ape_ptr, pos_ptr, i, loc, offs, mask,
                    stride_state, stride_new, stride_ape, RATIO: tl.constexpr, HAS_APE: tl.constexpr):
    """Columns offs of token i's fresh kv and score (the score with its position's ape row, as
    the pooling reads it) into ring row loc: the ring update the fused launches carry."""
    a = tl.load(kv_new_ptr + i * stride_new + offs, mask=mask)
    b = tl.load(score_new_ptr + i * stride_new + offs, mask=mask)
    if HAS_APE:
        b += tl.load(ape_ptr + (tl.load(pos_ptr + i) % RATIO) * stride_ape + offs, mask=mask, other=0.0)
    tl.store(kv_state_ptr + loc * stride_state + offs, a, mask=mask)
    tl.store(score_state_ptr + loc * stride_state + offs, b, mask=mask)


@triton.jit
def _compressor_pool_kernel(
    kv_state_ptr, score_state_ptr, kv_new_ptr, score_new_ptr, idx_ptr, out_ptr, ape_ptr, pos_ptr,
    stride_state, stride_new, stride_idx, stride_out, stride_ape, D, E, ring_loc_ptr, T,
    RATIO: tl.constexpr, COFF: tl.constexpr, BLOCK_C: tl.constexpr, HAS_APE: tl.constexpr,
    RING_WRITE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    i = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = c < D
    if i < E:
        idx = tl.load(idx_ptr + i * stride_idx + tl.arange(0, RATIO * COFF)).to(tl.int64)
        pooled = _pool_tile(kv_state_ptr, score_state_ptr, kv_new_ptr, score_new_ptr, idx, c, c_mask, ape_ptr,
                            pos_ptr, stride_state, stride_new, stride_ape, D, RATIO, COFF, HAS_APE)
        tl.store(out_ptr + i * stride_out + c, pooled, mask=c_mask)
    if RING_WRITE:
        if i < T:  # the same channels of token i's fresh kv and score (ape added) into its ring row
            loc = tl.load(ring_loc_ptr + i).to(tl.int64)
            mask = c_mask & ((c * 0 + loc) >= 0)  # vector compare: see cache_write
            for h in tl.static_range(COFF):  # ratio 4 rows hold two halves of D channels
                _ring_row_store(kv_state_ptr, score_state_ptr, kv_new_ptr, score_new_ptr, ape_ptr, pos_ptr, i, loc,
                                h * D + c, mask, stride_state, stride_new, stride_ape, RATIO, HAS_APE)


@triton.jit
def _compressor_emit_kernel(
    kv_state_ptr, score_state_ptr, kv_new_ptr, score_new_ptr, idx_ptr, pooled_ptr, ape_ptr, pos_ptr,
    stride_state, stride_new, stride_idx, stride_pooled, stride_ape, D, E,
    weight_ptr, eps, cos_ptr, sin_ptr, stride_cs, stride_cs_k, emit_pos_ptr, out_loc_ptr,
    entries_ptr, stride_entries, pool_ptr, stride_pool, rope_pool_ptr, stride_rope, scale_offset,
    amax_floor, inv_qmax, rope_dim, ring_loc_ptr, T,
    RATIO: tl.constexpr, COFF: tl.constexpr, BLOCK_C: tl.constexpr, HAS_APE: tl.constexpr,
    BLOCK_HALF: tl.constexpr, HAS_OUT: tl.constexpr, HAS_POOL: tl.constexpr, NOPE_FP8: tl.constexpr,
    FP8_ROWS: tl.constexpr, NUM_SCALES: tl.constexpr, PAIRS_PER_BLOCK: tl.constexpr,
    RING_WRITE: tl.constexpr, BLOCK_RING: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    i = tl.program_id(0).to(tl.int64)
    if i < E:
        # pool every channel of emission i into its fp32 row of `pooled`, then read that row
        # back as the row kernel reads its input (even / odd dims)
        idx = tl.load(idx_ptr + i * stride_idx + tl.arange(0, RATIO * COFF)).to(tl.int64)
        for c0 in range(0, D, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            c_mask = c < D
            pooled = _pool_tile(kv_state_ptr, score_state_ptr, kv_new_ptr, score_new_ptr, idx, c, c_mask, ape_ptr,
                                pos_ptr, stride_state, stride_new, stride_ape, D, RATIO, COFF, HAS_APE)
            tl.store(pooled_ptr + i * stride_pooled + c, pooled, mask=c_mask)
        tl.debug_barrier()  # the row's other channels came from other threads of this program
        k = tl.arange(0, BLOCK_HALF)
        k_mask = k < D // 2
        row = pooled_ptr + i * stride_pooled
        x0 = tl.load(row + 2 * k, mask=k_mask, other=0.0)
        x1 = tl.load(row + 2 * k + 1, mask=k_mask, other=0.0)
        pos = tl.load(emit_pos_ptr + i).to(tl.int64)
        loc = tl.load(out_loc_ptr + i).to(tl.int64) if HAS_POOL else i
        norm_rope_store_row(
            x0, x1, k, k_mask, pos, loc, entries_ptr + i * stride_entries, weight_ptr, cos_ptr, sin_ptr,
            stride_cs, stride_cs_k, pool_ptr, stride_pool, rope_pool_ptr, stride_rope, scale_offset, amax_floor,
            inv_qmax, D, rope_dim, eps, True, True, False, HAS_OUT, HAS_POOL, BLOCK_HALF, NOPE_FP8, FP8_ROWS,
            NUM_SCALES, PAIRS_PER_BLOCK)
    if RING_WRITE:
        if i < T:  # token i's fresh kv and score (ape added) into its ring row
            C = COFF * D
            loc = tl.load(ring_loc_ptr + i).to(tl.int64)
            for c0 in range(0, C, BLOCK_RING):
                offs = c0 + tl.arange(0, BLOCK_RING)
                mask = (offs < C) & ((offs * 0 + loc) >= 0)  # vector compare: see cache_write
                _ring_row_store(kv_state_ptr, score_state_ptr, kv_new_ptr, score_new_ptr, ape_ptr, pos_ptr, i, loc,
                                offs, mask, stride_state, stride_new, stride_ape, RATIO, HAS_APE)


def _pool_args(kv_state, score_state, kv_new, score_new, gather_idx, ratio, out):
    """(coff, emissions E, channels D) of a pooling call, its tensors checked."""
    assert ratio in (4, 128)
    coff = 2 if ratio == 4 else 1
    E, R = gather_idx.shape
    assert R == coff * ratio
    D = out.shape[1]
    assert kv_state.shape[-1] == coff * D and kv_new.shape[-1] == coff * D
    assert kv_state.is_contiguous() and score_state.is_contiguous()
    assert kv_new.stride(-1) == 1 and kv_new.stride() == score_new.stride()
    assert gather_idx.stride(-1) == 1 and out.stride(-1) == 1
    return coff, E, D


def compressor_pool(kv_state, score_state, kv_new, score_new, gather_idx, ratio, out, ape=None, positions=None,
                    ring_write_loc=None):
    """ring_write_loc: compressor_state_update of this step's tokens (rows unique) in the same
    launch, each program writing its channels of one token's ring row; only when no emission
    reads a ring row the step writes (a decode step), as for compressor_emit."""
    coff, E, D = _pool_args(kv_state, score_state, kv_new, score_new, gather_idx, ratio, out)
    T = ring_write_loc.shape[0] if ring_write_loc is not None else 0
    if max(E, T) == 0:
        return out
    # Register-sized tiles of [R, BLOCK_C] fp32 (sm_90 reports: no spills; sgl-kernel/benchmark/sm90_resources.py).
    block_c = min(next_power_of_2(D), 32 if ratio == 128 else 256)
    has_ape = _check_ape(ape, positions, ratio, kv_new)
    _compressor_pool_kernel[(max(E, T), cdiv(D, block_c))](
        kv_state, score_state, kv_new, score_new, gather_idx, out, ape if has_ape else out,
        positions if has_ape else gather_idx,
        kv_state.shape[-1], kv_new.stride(0), gather_idx.stride(0), out.stride(0), ape.stride(0) if has_ape else 0, D,
        E, ring_write_loc if ring_write_loc is not None else gather_idx, T,
        RATIO=ratio, COFF=coff, BLOCK_C=block_c, HAS_APE=has_ape, RING_WRITE=ring_write_loc is not None,
        num_warps=8 if ratio == 128 else 4, **pdl.options(kv_state))
    return out


def compressor_emit(kv_state, score_state, kv_new, score_new, gather_idx, ratio, pooled, norm_weight, eps, cos, sin,
                    emit_pos, rope_dim, pool, out_loc, entries=None, nope_fp8=False, ape=None, positions=None,
                    ring_write_loc=None):
    """compressor_pool into `pooled` ([E, D] fp32 scratch), then rmsnorm_rope_store of its rows
    (into pool at out_loc, or into entries), and with ring_write_loc compressor_state_update
    (rows unique), in one launch. ring_write_loc may only be given when no emission reads a
    ring row this step writes: each request feeds one token (a decode step)."""
    coff, E, D = _pool_args(kv_state, score_state, kv_new, score_new, gather_idx, ratio, pooled)
    assert cos.stride() == sin.stride() and D % 2 == 0 and rope_dim % 2 == 0 and rope_dim <= D
    T = ring_write_loc.shape[0] if ring_write_loc is not None else 0
    if max(E, T) == 0:
        return
    has_ape = _check_ape(ape, positions, ratio, kv_new)
    layout, nope_fp8 = pool_layout(pool, D, rope_dim, nope_fp8, "compressor_emit pool")
    if entries is not None:
        assert entries.shape == (E, D) and entries.stride(-1) == 1
    rope_pool = layout.rope(pool) if layout is not None else pooled
    # ratio 128: [128, 16] fp32 tiles (at 4 warps [128, 32] spills on sm_90:
    # sgl-kernel/benchmark/sm90_resources.py); ratio 4: [8, 256]
    block_c = min(next_power_of_2(D), 16 if ratio == 128 else 256)
    _compressor_emit_kernel[(max(E, T),)](
        kv_state, score_state, kv_new, score_new, gather_idx, pooled, ape if has_ape else pooled,
        positions if has_ape else gather_idx, kv_state.shape[-1], kv_new.stride(0), gather_idx.stride(0),
        pooled.stride(0), ape.stride(0) if has_ape else 0, D, E,
        norm_weight, float(eps), cos, sin, cos.stride(0), cos.stride(1), emit_pos,
        out_loc if pool is not None else emit_pos,
        entries if entries is not None else pooled, entries.stride(0) if entries is not None else 0,
        pool if pool is not None else pooled, pool.stride(0) if pool is not None else 0,
        rope_pool, rope_pool.stride(0), layout.scale_offset if layout else 0,
        AMAX_FLOOR, INV_E4M3_MAX, rope_dim,
        ring_write_loc if ring_write_loc is not None else emit_pos, T,
        RATIO=ratio, COFF=coff, BLOCK_C=block_c, HAS_APE=has_ape, HAS_OUT=entries is not None,
        HAS_POOL=pool is not None, RING_WRITE=ring_write_loc is not None,
        BLOCK_RING=min(next_power_of_2(coff * D), 1024), **store_row_constexprs(D, rope_dim, pool, nope_fp8, layout),
        **pdl.options(kv_state))


def compressor_norm_rope_store(pooled, norm_weight, eps, cos, sin, emit_pos, rope_dim, pool,
                               emit_out_loc):
    rmsnorm_rope_store(pooled, norm_weight, eps, cos, sin, emit_pos, rope_dim, pool, emit_out_loc)


@triton.jit
def _scatter_rows_kernel(src_a_ptr, src_b_ptr, dst_a_ptr, dst_b_ptr, loc_ptr, ape_ptr, pos_ptr, stride_src,
                         stride_dst, stride_ape, C, ratio, BLOCK: tl.constexpr, HAS_APE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    loc = tl.load(loc_ptr + t).to(tl.int64)
    mask = (offs < C) & ((offs * 0 + loc) >= 0)  # vector compare: see cache_write
    a = tl.load(src_a_ptr + t * stride_src + offs, mask=mask)
    b = tl.load(src_b_ptr + t * stride_src + offs, mask=mask)
    if HAS_APE:  # the score with its position's ape row, as the pooling read it
        pos = tl.load(pos_ptr + t)
        b += tl.load(ape_ptr + (pos % ratio) * stride_ape + offs, mask=mask, other=0.0)
    tl.store(dst_a_ptr + loc * stride_dst + offs, a.to(dst_a_ptr.dtype.element_ty), mask=mask)
    tl.store(dst_b_ptr + loc * stride_dst + offs, b.to(dst_b_ptr.dtype.element_ty), mask=mask)


def _check_ape(ape, positions, ratio, kv_new) -> bool:
    """Whether an ape table comes with the fresh scores: [ratio, C] fp32 rows, positions [T]."""
    if ape is None:
        return False
    assert positions is not None and positions.shape[0] >= kv_new.shape[0]
    assert ape.shape == (ratio, kv_new.shape[-1]) and ape.stride(-1) == 1 and ape.dtype == torch.float32
    return True


def compressor_state_update(kv_state, score_state, kv_new, score_new, ring_write_loc, rows_unique=False,
                            ape=None, positions=None):
    T = ring_write_loc.shape[0]
    if T == 0:
        return
    C = kv_state.shape[-1]
    assert kv_state.is_contiguous() and score_state.is_contiguous()
    assert kv_new.stride(-1) == 1 and kv_new.stride() == score_new.stride()
    num_rows = kv_state.numel() // C
    # When a chunk wraps the ring, only the newest token of each row may write: racing
    # programs would otherwise leave an arbitrary one. A dozen small torch launches, no sync;
    # skipped when the caller's locs are unique already.
    if rows_unique:
        loc = ring_write_loc
    else:
        keep = reference.ring_write_winners(ring_write_loc, num_rows)
        loc = torch.where(keep, ring_write_loc.long(), -1)
    block = min(next_power_of_2(C), 1024)
    ratio = ape.shape[0] if ape is not None else 1
    has_ape = _check_ape(ape, positions, ratio, kv_new)
    _scatter_rows_kernel[(T, cdiv(C, block))](
        kv_new, score_new, kv_state, score_state, loc, ape if has_ape else kv_new, positions if has_ape else loc,
        kv_new.stride(0), C, ape.stride(0) if has_ape else 0, C, ratio,
        BLOCK=block, HAS_APE=has_ape, num_warps=4,
    )
