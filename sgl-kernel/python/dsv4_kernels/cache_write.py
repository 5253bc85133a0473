"""Triton row kernel for RMSNorm + interleaved RoPE (+ inverse RoPE) and the KV-cache write.

One program per row (a token, or a token's head). Even and odd elements are loaded as two
vectors so a GPT-J pair (x[2k], x[2k+1]) sits at the same lane of both.
"""

import triton
import triton.language as tl


@triton.jit
def _norm_rope_row_kernel(
    x_ptr, stride_xt, stride_xh, weight_ptr, cos_ptr, sin_ptr, stride_cs, stride_cs_k, pos_ptr,
    out_ptr, stride_ot, stride_oh, pool_ptr, stride_pool, loc_ptr,
    H, D, rope_dim, eps,
    HAS_NORM: tl.constexpr, HAS_WEIGHT: tl.constexpr, INVERSE: tl.constexpr,
    HAS_OUT: tl.constexpr, HAS_POOL: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    pid = tl.program_id(0)
    t = (pid // H).to(tl.int64)
    h = pid % H
    k = tl.arange(0, BLOCK_HALF)  # pair index
    k_mask = k < D // 2
    row = x_ptr + t * stride_xt + h * stride_xh
    x0 = tl.load(row + 2 * k, mask=k_mask, other=0.0).to(tl.float32)
    x1 = tl.load(row + 2 * k + 1, mask=k_mask, other=0.0).to(tl.float32)

    if HAS_NORM:
        inv_rms = tl.rsqrt((tl.sum(x0 * x0, 0) + tl.sum(x1 * x1, 0)) / D + eps)
        x0 = x0 * inv_rms
        x1 = x1 * inv_rms
        if HAS_WEIGHT:
            x0 = x0 * tl.load(weight_ptr + 2 * k, mask=k_mask, other=0.0).to(tl.float32)
            x1 = x1 * tl.load(weight_ptr + 2 * k + 1, mask=k_mask, other=0.0).to(tl.float32)

    # RoPE covers the last rope_dim dims: pairs k >= (D - rope_dim) / 2.
    first_rope_pair = (D - rope_dim) // 2
    rope_mask = k_mask & (k >= first_rope_pair)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    freq = tl.maximum(k - first_rope_pair, 0)
    cs_off = pos * stride_cs + freq * stride_cs_k
    c = tl.load(cos_ptr + cs_off, mask=rope_mask, other=1.0).to(tl.float32)
    s = tl.load(sin_ptr + cs_off, mask=rope_mask, other=0.0).to(tl.float32)
    if INVERSE:
        s = -s
    y0 = x0 * c - x1 * s
    y1 = x0 * s + x1 * c

    if HAS_OUT:
        orow = out_ptr + t * stride_ot + h * stride_oh
        tl.store(orow + 2 * k, y0.to(out_ptr.dtype.element_ty), mask=k_mask)
        tl.store(orow + 2 * k + 1, y1.to(out_ptr.dtype.element_ty), mask=k_mask)
    if HAS_POOL:
        loc = tl.load(loc_ptr + t).to(tl.int64)
        # -1 marks a padding token: nothing is written. (loc is broadcast to a vector before
        # the compare: the interpreter rejects a scalar-bool & vector-bool mask.)
        pmask = k_mask & ((k * 0 + loc) >= 0)
        prow = pool_ptr + loc * stride_pool
        tl.store(prow + 2 * k, y0.to(pool_ptr.dtype.element_ty), mask=pmask)
        tl.store(prow + 2 * k + 1, y1.to(pool_ptr.dtype.element_ty), mask=pmask)


def _launch(x3, weight, eps, cos, sin, positions, rope_dim, out3, pool, out_loc, *, norm, inverse):
    """x3/out3 are [T, H, D] views; pool/out_loc optional."""
    T, H, D = x3.shape
    assert D % 2 == 0 and rope_dim % 2 == 0 and rope_dim <= D
    # cos/sin may be two tables or the two halves of one [max_pos, rope_dim/2, 2] table.
    assert x3.stride(-1) == 1 and cos.stride() == sin.stride()
    if T == 0:
        return
    has_out = out3 is not None
    has_pool = pool is not None
    if has_pool:
        assert pool.stride(-1) == 1 and pool.shape[-1] == D
    if has_out:
        assert out3.stride(-1) == 1
    block_half = triton.next_power_of_2(D // 2)
    _norm_rope_row_kernel[(T * H,)](
        x3, x3.stride(0), x3.stride(1), weight if weight is not None else x3,
        cos, sin, cos.stride(0), cos.stride(1), positions,
        out3 if has_out else x3, out3.stride(0) if has_out else 0, out3.stride(1) if has_out else 0,
        pool if has_pool else x3, pool.stride(0) if has_pool else 0,
        out_loc if has_pool else positions,
        H, D, rope_dim, float(eps),
        HAS_NORM=norm, HAS_WEIGHT=weight is not None, INVERSE=inverse,
        HAS_OUT=has_out, HAS_POOL=has_pool, BLOCK_HALF=block_half,
        num_warps=4 if D >= 512 else 1,
    )


def rmsnorm_rope_store(kv, norm_weight, eps, cos, sin, positions, rope_dim, pool, out_loc,
                       kv_out=None):
    _launch(kv[:, None, :], norm_weight, eps, cos, sin, positions, rope_dim,
            kv_out[:, None, :] if kv_out is not None else None, pool, out_loc,
            norm=True, inverse=False)
    return kv_out


def q_rms_rope(q, cos, sin, positions, rope_dim, eps):
    _launch(q, None, eps, cos, sin, positions, rope_dim, q, None, None, norm=True, inverse=False)
    return q


def inverse_rope_(o, cos, sin, positions, rope_dim):
    _launch(o, None, 0.0, cos, sin, positions, rope_dim, o, None, None, norm=False, inverse=True)
    return o
