"""Triton row kernel for RMSNorm + interleaved RoPE (+ inverse RoPE) and the KV-cache write.

One program per row (a token, or a token's head). Even and odd elements are loaded as two
vectors so a GPT-J pair (x[2k], x[2k+1]) sits at the same lane of both.

The KV write can round the nope dims to FP8 per 64 (release numerics) into a float pool, or
store FP8 rows (kv_fp8.py) into a uint8 pool. The e4m3 encoding is integer arithmetic on the
fp32 bits (round to nearest even), not a cast: the interpreter's fp8 cast does not round to
nearest even, and bit-exact agreement with the torch reference is the contract.
"""

import torch
import triton
import triton.language as tl

from . import pdl
from .host_math import cdiv, next_power_of_2
from .kv_fp8 import KV_FP8_BLOCK, FP8KVLayout
from .quant_reference import AMAX_FLOOR, E4M3_MAX

# fp32(1 / 448), the factor pow2_scale multiplies amax by (as a float32 kernel argument)
INV_E4M3_MAX = float(torch.tensor(1.0 / E4M3_MAX, dtype=torch.float32))


@triton.jit
def _pow2_scale_exp(amax, amax_floor, inv_qmax):
    """quant_reference.pow2_scale as its exponent field: 2^(e - 127) is the smallest power of
    two >= max(amax, floor) * fp32(1 / qmax)."""
    s = tl.maximum(amax, amax_floor) * inv_qmax
    bits = s.to(tl.int32, bitcast=True)
    return ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def _e4m3_code(v):
    """fp32 -> e4m3fn byte (as int32), round to nearest even, saturating at +-448: the same
    byte as torch's cast of v.clamp(-448, 448) (a negative value that rounds to 0 keeps its sign)."""
    vbits = v.to(tl.int32, bitcast=True)
    sign = (vbits >> 24) & 0x80
    a = tl.minimum(tl.abs(v), 448.0)
    abits = a.to(tl.int32, bitcast=True)
    exp = (abits >> 23) - 127
    # normal e4m3 (|a| >= 2^-6): keep 3 mantissa bits of the fp32 bits, ties to even; a carry
    # out of the mantissa bumps the exponent, as it should
    low = abits & 0xFFFFF
    keep = abits >> 20
    up = (low > 0x80000) | ((low == 0x80000) & ((keep & 1) == 1))
    r = keep + up.to(tl.int32)  # (fp32 exponent << 3) | 3 mantissa bits
    normal = r - (120 << 3)  # e4m3 exponent bias 7 vs fp32's 127
    # subnormal e4m3 (|a| < 2^-6): a / 2^-9 rounded to an integer 0..8 (8 is 2^-6, code 8)
    mant = (abits & 0x7FFFFF) | 0x800000  # a = mant * 2^(exp - 23)
    shift = tl.minimum(14 - exp, 30)  # a / 2^-9 = mant >> shift (>= 25 gives 0 anyway)
    sub_low = mant & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    sub = (mant >> shift) + ((sub_low > half) | ((sub_low == half) & (((mant >> shift) & 1) == 1))).to(tl.int32)
    return sign | tl.where(exp >= -6, normal, sub)


@triton.jit
def _e4m3_value(code):
    return code.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _encode_e4m3_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n).to(tl.float32)
    tl.store(out_ptr + i, _e4m3_code(x).to(tl.uint8), mask=i < n)


def encode_e4m3(x):
    """uint8 e4m3 bytes of a contiguous float tensor through the write kernel's encoder (the
    tests hold it to torch's cast, ties and subnormals included)."""
    out = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    if x.numel():
        _encode_e4m3_kernel[(cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    return out


@triton.jit
def _load_pairs(row, k, k_mask):
    """A row's even and odd elements (pairs k) in fp32."""
    x0 = tl.load(row + 2 * k, mask=k_mask, other=0.0).to(tl.float32)
    x1 = tl.load(row + 2 * k + 1, mask=k_mask, other=0.0).to(tl.float32)
    return x0, x1


@triton.jit
def _norm_rope_row_kernel(
    x_ptr, stride_xt, stride_xh, weight_ptr, cos_ptr, sin_ptr, stride_cs, stride_cs_k, pos_ptr,
    out_ptr, stride_ot, stride_oh, pool_ptr, stride_pool, loc_ptr,
    rope_pool_ptr, stride_rope, scale_offset, amax_floor, inv_qmax,
    H, D, rope_dim, eps,
    HAS_NORM: tl.constexpr, HAS_WEIGHT: tl.constexpr, INVERSE: tl.constexpr,
    HAS_OUT: tl.constexpr, HAS_POOL: tl.constexpr, BLOCK_HALF: tl.constexpr,
    NOPE_FP8: tl.constexpr, FP8_ROWS: tl.constexpr, NUM_SCALES: tl.constexpr,
    PAIRS_PER_BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    pid = tl.program_id(0)
    t = (pid // H).to(tl.int64)
    h = pid % H
    k = tl.arange(0, BLOCK_HALF)  # pair index
    k_mask = k < D // 2
    x0, x1 = _load_pairs(x_ptr + t * stride_xt + h * stride_xh, k, k_mask)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    loc = tl.load(loc_ptr + t).to(tl.int64) if HAS_POOL else t
    norm_rope_store_row(
        x0, x1, k, k_mask, pos, loc, out_ptr + t * stride_ot + h * stride_oh, weight_ptr, cos_ptr, sin_ptr,
        stride_cs, stride_cs_k, pool_ptr, stride_pool, rope_pool_ptr, stride_rope, scale_offset, amax_floor,
        inv_qmax, D, rope_dim, eps, HAS_NORM, HAS_WEIGHT, INVERSE, HAS_OUT, HAS_POOL, BLOCK_HALF, NOPE_FP8,
        FP8_ROWS, NUM_SCALES, PAIRS_PER_BLOCK)


@triton.jit
def _q_kv_norm_rope_kernel(
    q_ptr, stride_qt, stride_qh, kv_ptr, stride_kvt, weight_ptr, cos_ptr, sin_ptr, stride_cs, stride_cs_k, pos_ptr,
    pool_ptr, stride_pool, loc_ptr, rope_pool_ptr, stride_rope, scale_offset, amax_floor, inv_qmax,
    T, H, D, rope_dim, eps,
    BLOCK_HALF: tl.constexpr, NOPE_FP8: tl.constexpr, FP8_ROWS: tl.constexpr, NUM_SCALES: tl.constexpr,
    PAIRS_PER_BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Programs below T * H: q_rms_rope's rows (in place); the T after them: rmsnorm_rope_store's
    kv rows into the pool. Each row takes the very path of its own launch (same row function,
    same flags, same warps), so both are bit for bit what the two launches write."""
    pdl.enter(PDL)
    pid = tl.program_id(0)
    k = tl.arange(0, BLOCK_HALF)
    k_mask = k < D // 2
    if pid < T * H:
        t = (pid // H).to(tl.int64)
        row = q_ptr + t * stride_qt + (pid % H) * stride_qh
        x0, x1 = _load_pairs(row, k, k_mask)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        norm_rope_store_row(
            x0, x1, k, k_mask, pos, t, row, weight_ptr, cos_ptr, sin_ptr, stride_cs, stride_cs_k, pool_ptr,
            stride_pool, rope_pool_ptr, stride_rope, scale_offset, amax_floor, inv_qmax, D, rope_dim, eps,
            True, False, False, True, False, BLOCK_HALF, False, False, 0, PAIRS_PER_BLOCK)
    else:
        t = (pid - T * H).to(tl.int64)
        row = kv_ptr + t * stride_kvt
        x0, x1 = _load_pairs(row, k, k_mask)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        loc = tl.load(loc_ptr + t).to(tl.int64)
        norm_rope_store_row(
            x0, x1, k, k_mask, pos, loc, row, weight_ptr, cos_ptr, sin_ptr, stride_cs, stride_cs_k, pool_ptr,
            stride_pool, rope_pool_ptr, stride_rope, scale_offset, amax_floor, inv_qmax, D, rope_dim, eps,
            True, True, False, False, True, BLOCK_HALF, NOPE_FP8, FP8_ROWS, NUM_SCALES, PAIRS_PER_BLOCK)


@triton.jit
def norm_rope_store_row(
    x0, x1, k, k_mask, pos, loc, orow, weight_ptr, cos_ptr, sin_ptr, stride_cs, stride_cs_k,
    pool_ptr, stride_pool, rope_pool_ptr, stride_rope, scale_offset, amax_floor, inv_qmax, D, rope_dim, eps,
    HAS_NORM: tl.constexpr, HAS_WEIGHT: tl.constexpr, INVERSE: tl.constexpr,
    HAS_OUT: tl.constexpr, HAS_POOL: tl.constexpr, BLOCK_HALF: tl.constexpr,
    NOPE_FP8: tl.constexpr, FP8_ROWS: tl.constexpr, NUM_SCALES: tl.constexpr,
    PAIRS_PER_BLOCK: tl.constexpr,
):
    """One row's pairs (x0 = even dims, x1 = odd, fp32) through the norm, the RoPE at `pos` and
    the stores: `orow` (the row's output, HAS_OUT) and pool row `loc` (HAS_POOL; -1 skips).
    Shared by the row kernel and the compressor's fused emission kernel."""
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
    freq = tl.maximum(k - first_rope_pair, 0)
    cs_off = pos * stride_cs + freq * stride_cs_k
    c = tl.load(cos_ptr + cs_off, mask=rope_mask, other=1.0).to(tl.float32)
    s = tl.load(sin_ptr + cs_off, mask=rope_mask, other=0.0).to(tl.float32)
    if INVERSE:
        s = -s
    y0 = x0 * c - x1 * s
    y1 = x0 * s + x1 * c

    if HAS_OUT:
        tl.store(orow + 2 * k, y0.to(orow.dtype.element_ty), mask=k_mask)
        tl.store(orow + 2 * k + 1, y1.to(orow.dtype.element_ty), mask=k_mask)
    if HAS_POOL:
        # -1 marks a padding token: nothing is written. (loc is broadcast to a vector before
        # the compare: the interpreter rejects a scalar-bool & vector-bool mask.)
        pmask = k_mask & ((k * 0 + loc) >= 0)
        prow = pool_ptr + loc * stride_pool
        if NOPE_FP8:
            # Nope pairs k < first_rope_pair; 64 dims = 32 pairs per scale block. A static loop
            # over the few blocks: masked amax, then the block's exponent on its lanes.
            nope = k < first_rope_pair
            blk = k // (PAIRS_PER_BLOCK)
            a = tl.where(nope & k_mask, tl.maximum(tl.abs(y0), tl.abs(y1)), 0.0)
            exp = tl.zeros([BLOCK_HALF], tl.int32)
            for b in tl.static_range(NUM_SCALES):
                amax_b = tl.max(tl.where(blk == b, a, 0.0), 0)
                exp = tl.where(blk == b, _pow2_scale_exp(amax_b, amax_floor, inv_qmax), exp)
            exp = tl.where(nope, exp, 127)  # scale 1 outside the nope blocks (unused)
            scale = (exp << 23).to(tl.float32, bitcast=True)
            # times the exact reciprocal power of two (= torch's x / scale; a GPU fp32 division
            # need not be correctly rounded)
            inv_scale = ((254 - exp) << 23).to(tl.float32, bitcast=True)
            c0 = _e4m3_code(y0 * inv_scale)
            c1 = _e4m3_code(y1 * inv_scale)
            if FP8_ROWS:
                nmask = pmask & nope
                tl.store(prow + 2 * k, c0.to(tl.uint8), mask=nmask)
                tl.store(prow + 2 * k + 1, c1.to(tl.uint8), mask=nmask)
                # one scale byte per block, from the block's first lane
                first = nmask & (k % (PAIRS_PER_BLOCK) == 0)
                tl.store(prow + scale_offset + blk, exp.to(tl.uint8), mask=first)
                # rope dims through the pool's rope view (kv_fp8.FP8KVLayout.rope: model dtype)
                rmask = pmask & (k >= first_rope_pair)
                rrow = rope_pool_ptr + loc * stride_rope
                j = 2 * (k - first_rope_pair)
                tl.store(rrow + j, y0.to(rope_pool_ptr.dtype.element_ty), mask=rmask)
                tl.store(rrow + j + 1, y1.to(rope_pool_ptr.dtype.element_ty), mask=rmask)
            else:
                y0 = tl.where(nope, _e4m3_value(c0) * scale, y0)
                y1 = tl.where(nope, _e4m3_value(c1) * scale, y1)
        if not FP8_ROWS:
            tl.store(prow + 2 * k, y0.to(pool_ptr.dtype.element_ty), mask=pmask)
            tl.store(prow + 2 * k + 1, y1.to(pool_ptr.dtype.element_ty), mask=pmask)


def pool_layout(pool, D, rope_dim, nope_fp8, what):
    """(the FP8 row layout of a uint8 KV pool or None, whether its nope dims are FP8-rounded):
    a uint8 pool always is; a float pool when nope_fp8. Checks the pool's rows and the split."""
    if pool is None:
        return None, nope_fp8
    assert pool.stride(-1) == 1
    if pool.dtype == torch.uint8:
        layout = FP8KVLayout.of_rows(pool, D, rope_dim)
        layout.check_rows(pool, what)
        return layout, True
    assert pool.shape[-1] == D
    if nope_fp8:
        FP8KVLayout(D, rope_dim)  # validates the nope / rope split
    return None, nope_fp8


def store_row_constexprs(D, rope_dim, pool, nope_fp8, layout) -> dict:
    """norm_rope_store_row's store flags and tiles for rows of D with pool (None: no store) in
    pool_layout's (layout, nope_fp8), and the warps its launches take."""
    return dict(BLOCK_HALF=max(next_power_of_2(D // 2), KV_FP8_BLOCK // 2),
                NOPE_FP8=bool(pool is not None and nope_fp8), FP8_ROWS=layout is not None,
                NUM_SCALES=(D - rope_dim) // KV_FP8_BLOCK if nope_fp8 else 0, PAIRS_PER_BLOCK=KV_FP8_BLOCK // 2,
                num_warps=4 if D >= 512 else 1)


def _launch(x3, weight, eps, cos, sin, positions, rope_dim, out3, pool, out_loc, *, norm, inverse,
            nope_fp8=False):
    """x3/out3 are [T, H, D] views; pool/out_loc optional. A uint8 pool holds FP8 KV rows."""
    T, H, D = x3.shape
    assert D % 2 == 0 and rope_dim % 2 == 0 and rope_dim <= D
    # cos/sin may be two tables or the two halves of one [max_pos, rope_dim/2, 2] table.
    assert x3.stride(-1) == 1 and cos.stride() == sin.stride()
    has_out = out3 is not None
    has_pool = pool is not None
    layout, nope_fp8 = pool_layout(pool, D, rope_dim, nope_fp8, "rmsnorm_rope_store pool")
    if has_out:
        assert out3.stride(-1) == 1
    if T == 0:
        return
    rope_pool = layout.rope(pool) if layout is not None else x3
    _norm_rope_row_kernel[(T * H,)](
        x3, x3.stride(0), x3.stride(1), weight if weight is not None else x3,
        cos, sin, cos.stride(0), cos.stride(1), positions,
        out3 if has_out else x3, out3.stride(0) if has_out else 0, out3.stride(1) if has_out else 0,
        pool if has_pool else x3, pool.stride(0) if has_pool else 0,
        out_loc if has_pool else positions,
        rope_pool, rope_pool.stride(0), layout.scale_offset if layout else 0,
        AMAX_FLOOR, INV_E4M3_MAX,
        H, D, rope_dim, float(eps),
        HAS_NORM=norm, HAS_WEIGHT=weight is not None, INVERSE=inverse, HAS_OUT=has_out, HAS_POOL=has_pool,
        **store_row_constexprs(D, rope_dim, pool, nope_fp8, layout), **pdl.options(x3))


def rmsnorm_rope_store(kv, norm_weight, eps, cos, sin, positions, rope_dim, pool, out_loc,
                       kv_out=None, nope_fp8=False):
    _launch(kv[:, None, :], norm_weight, eps, cos, sin, positions, rope_dim,
            kv_out[:, None, :] if kv_out is not None else None, pool, out_loc,
            norm=True, inverse=False, nope_fp8=nope_fp8)
    return kv_out


def q_kv_norm_rope_store(q, kv, norm_weight, eps, cos, sin, positions, rope_dim, pool, out_loc, nope_fp8=False):
    """q_rms_rope(q, ...) and rmsnorm_rope_store(kv, norm_weight, ..., pool, out_loc) in one
    launch: a layer's q heads [T, H, D] and its kv rows [T, D] share the head dim, the positions
    and the tables."""
    T, H, D = q.shape
    assert kv.shape == (T, D) and q.stride(-1) == 1 and kv.stride(-1) == 1 and pool is not None
    assert D % 2 == 0 and rope_dim % 2 == 0 and rope_dim <= D and cos.stride() == sin.stride()
    layout, nope_fp8 = pool_layout(pool, D, rope_dim, nope_fp8, "q_kv_norm_rope_store pool")
    if T == 0:
        return q
    rope_pool = layout.rope(pool) if layout is not None else kv
    _q_kv_norm_rope_kernel[(T * H + T,)](
        q, q.stride(0), q.stride(1), kv, kv.stride(0), norm_weight, cos, sin, cos.stride(0), cos.stride(1), positions,
        pool, pool.stride(0), out_loc, rope_pool, rope_pool.stride(0), layout.scale_offset if layout else 0,
        AMAX_FLOOR, INV_E4M3_MAX, T, H, D, rope_dim, float(eps),
        **store_row_constexprs(D, rope_dim, pool, nope_fp8, layout), **pdl.options(q))
    return q


def q_rms_rope(q, cos, sin, positions, rope_dim, eps):
    _launch(q, None, eps, cos, sin, positions, rope_dim, q, None, None, norm=True, inverse=False)
    return q


def inverse_rope_(o, cos, sin, positions, rope_dim):
    _launch(o, None, 0.0, cos, sin, positions, rope_dim, o, None, None, norm=False, inverse=True)
    return o
