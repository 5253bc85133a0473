"""Triton kernels of the KV compressor: per-channel softmax pooling of an emission's rows, and
the per-request ring-state update. Norm + RoPE + store of the pooled entry reuses cache_write.
"""

import torch
import triton
import triton.language as tl

from . import reference
from .cache_write import rmsnorm_rope_store
from .host_math import cdiv, next_power_of_2


@triton.jit
def _compressor_pool_kernel(
    kv_state_ptr, score_state_ptr, kv_new_ptr, score_new_ptr, idx_ptr, out_ptr, ape_ptr, pos_ptr,
    stride_state, stride_new, stride_idx, stride_out, stride_ape, D,
    RATIO: tl.constexpr, COFF: tl.constexpr, BLOCK_C: tl.constexpr, HAS_APE: tl.constexpr,
):
    e = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = c < D
    rows = tl.arange(0, RATIO * COFF)
    idx = tl.load(idx_ptr + e * stride_idx + rows).to(tl.int64)
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
    pooled = tl.sum(p * kv, 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + e * stride_out + c, pooled, mask=c_mask)


def compressor_pool(kv_state, score_state, kv_new, score_new, gather_idx, ratio, out, ape=None, positions=None):
    assert ratio in (4, 128)
    coff = 2 if ratio == 4 else 1
    E, R = gather_idx.shape
    assert R == coff * ratio
    D = out.shape[1]
    assert kv_state.shape[-1] == coff * D and kv_new.shape[-1] == coff * D
    assert kv_state.is_contiguous() and score_state.is_contiguous()
    assert kv_new.stride(-1) == 1 and kv_new.stride() == score_new.stride()
    assert gather_idx.stride(-1) == 1 and out.stride(-1) == 1
    if E == 0:
        return out
    # Register-sized tiles of [R, BLOCK_C] fp32 (sm_90 reports: no spills; sgl-kernel/benchmark/sm90_resources.py).
    block_c = min(next_power_of_2(D), 32 if ratio == 128 else 256)
    has_ape = _check_ape(ape, positions, ratio, kv_new)
    _compressor_pool_kernel[(E, cdiv(D, block_c))](
        kv_state, score_state, kv_new, score_new, gather_idx, out, ape if has_ape else out,
        positions if has_ape else gather_idx,
        kv_state.shape[-1], kv_new.stride(0), gather_idx.stride(0), out.stride(0), ape.stride(0) if has_ape else 0, D,
        RATIO=ratio, COFF=coff, BLOCK_C=block_c, HAS_APE=has_ape, num_warps=8 if ratio == 128 else 4,
    )
    return out


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
