"""Triton kernel for the indexer's q (and its emitted keys) in release numerics: interleaved
RoPE on the last rope_dim dims, the Walsh-Hadamard rotation (x dim^-0.5), FP4 rounding per 32.

In torch (Indexer.forward's fallback) these are about forty kernels over [T, heads, 128]
fp32 temporaries: the rotation's seven butterfly stages alone are an add, a sub and a stack
each. At a Flash-dims 4096-token step that was about 4 ms per c4 layer, more than the layer's
attention (docs/benchmarks.md §3). Here it is one pass over the bf16 rows.

Per program BLOCK_R rows of `dim` (= 128) elements, even and odd elements loaded as two
[BLOCK_R, dim/2] tiles (a RoPE pair at the same lane of both, as in cache_write.py):
1. RoPE in fp32, rounded to the row dtype (apply_rope_ writes back into q);
2. the rotation as two dots with the +-1 Sylvester matrix split into its even and odd rows
   (H[i, j] = (-1)^popcount(i & j), built from iotas): for bf16 rows on tensor cores (operands
   exact in bf16, products exact, summed in fp32), else fp32 products; the reference's fp32
   butterflies sum the same terms in another order. Times dim^-0.5 in fp32, rounded to the
   row dtype;
3. per 32 outputs the release's FP4 rounding (quant_reference.fp4_round_blocks): scale = the
   power of two >= max(amax, 1e-4) / 6, |v| / scale rounded to the e2m1 grid, ties to even.
Rows are rewritten in place. Static shapes, no syncs: graph capturable.

`rotate_round_pack_store` runs the same rotation and rounding on a compressor's emitted keys and
stores them packed (index_key_fp4.py: e2m1 codes + one e8m0 scale per 32) at their cache rows.
"""

import os

import torch
import triton
import triton.language as tl

from . import pdl
from .cache_write import _pow2_scale_exp
from .index_key_fp4 import IndexKeyFP4Layout
from .quant_reference import AMAX_FLOOR, E2M1_MAX, FP4_BLOCK

INV_E2M1_MAX = float(torch.tensor(1.0 / E2M1_MAX, dtype=torch.float32))  # fp32(1/6), as pow2_scale
# The interpreter's bf16 dots come out wrong (Triton 3.9 on CPU): there the fp32 dot, whose
# products of bf16 values are the same exact numbers.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
RNE_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: (a + M) - M rounds |a| < 2^22 to an integer, ties to even


@triton.jit
def _parity(v):
    """popcount(v) & 1 for 0 <= v < 256."""
    v = v ^ (v >> 4)
    v = v ^ (v >> 2)
    v = v ^ (v >> 1)
    return v & 1


@triton.jit
def _rotate_round_tile(x0, x1, scale, amax_floor, inv_qmax, dtype: tl.constexpr, DIM: tl.constexpr, BF16_DOT: tl.constexpr,
                       BLOCK_R: tl.constexpr, NUM_BLOCKS: tl.constexpr, QBLOCK: tl.constexpr):
    """Rows given as their even and odd elements x0, x1 [BLOCK_R, DIM/2] (fp32 holding row-dtype
    values) -> (y, r, exp), each [BLOCK_R, DIM]: y the rotated rows (rounded to the row dtype, as
    fp32), r = |y| on its block's e2m1 grid (in units of the block's scale) and exp the block's
    scale as its exponent field (2^(exp - 127), the e8m0 byte)."""
    HALF: tl.constexpr = DIM // 2
    k = tl.arange(0, HALF)
    # out[j] = sum_k x0[k] H[2k, j] + x1[k] H[2k + 1, j]; H[2k + 1, j] = H[2k, j] (-1)^(j & 1)
    j = tl.arange(0, DIM)
    h_even = 1.0 - 2.0 * _parity((2 * k)[:, None] & j[None, :]).to(tl.float32)
    h_odd = h_even * (1.0 - 2.0 * (j & 1).to(tl.float32))[None, :]
    if BF16_DOT:  # bf16 rows: exact operands, exact products, fp32 sums on tensor cores
        acc = tl.dot(x0.to(tl.bfloat16), h_even.to(tl.bfloat16))
        acc = tl.dot(x1.to(tl.bfloat16), h_odd.to(tl.bfloat16), acc)
    else:  # fp32 / fp16 rows: fp32 products
        acc = tl.dot(x0, h_even, input_precision="ieee")
        acc = tl.dot(x1, h_odd, acc, input_precision="ieee")
    y = (acc * scale).to(dtype).to(tl.float32)  # hadamard_rotate's result in the row dtype
    # FP4 per QBLOCK outputs: the block's amax on its lanes (a static loop over the blocks)
    blk = j // QBLOCK
    a = tl.abs(y)
    exp = tl.zeros([BLOCK_R, DIM], tl.int32)
    for b in tl.static_range(NUM_BLOCKS):
        amax_b = tl.max(tl.where((blk == b)[None, :], a, 0.0), 1)
        exp = tl.where((blk == b)[None, :], _pow2_scale_exp(amax_b, amax_floor, inv_qmax)[:, None], exp)
    inv_scale = ((254 - exp) << 23).to(tl.float32, bitcast=True)  # exact reciprocal power of two
    v = tl.minimum(a * inv_scale, 6.0)
    step = tl.where(v < 2.0, 0.5, tl.where(v < 4.0, 1.0, 2.0))
    inv_step = tl.where(v < 2.0, 2.0, tl.where(v < 4.0, 1.0, 0.5))  # a product, exact: no division
    r = tl.minimum(((v * inv_step + RNE_MAGIC) - RNE_MAGIC) * step, 6.0)
    return y, r, exp


@triton.jit
def _rope_rotate_round_kernel(x_ptr, stride_t, stride_h, cos_ptr, sin_ptr, stride_cs, stride_cs_k, pos_ptr,
                              R, H, rope_dim, scale, amax_floor, inv_qmax,
                              DIM: tl.constexpr, HAS_ROPE: tl.constexpr, ROTATE: tl.constexpr, BF16_DOT: tl.constexpr,
                              BLOCK_R: tl.constexpr, NUM_BLOCKS: tl.constexpr, QBLOCK: tl.constexpr,
                              PDL: tl.constexpr = False):
    pdl.enter(PDL)
    HALF: tl.constexpr = DIM // 2
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    k = tl.arange(0, HALF)
    # row r is head r % H of token r // H (a token's heads need not follow the last one's)
    row_off = (rows // H).to(tl.int64) * stride_t + (rows % H).to(tl.int64) * stride_h
    base = x_ptr + row_off[:, None] + 2 * k[None, :]
    m2 = rmask[:, None]
    x0 = tl.load(base, mask=m2, other=0.0).to(tl.float32)
    x1 = tl.load(base + 1, mask=m2, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty

    if HAS_ROPE:
        first = (DIM - rope_dim) // 2  # RoPE covers pairs k >= first
        on = m2 & (k[None, :] >= first)
        pos = tl.load(pos_ptr + rows // H, mask=rmask, other=0).to(tl.int64)
        off = pos[:, None] * stride_cs + tl.maximum(k - first, 0)[None, :] * stride_cs_k
        c = tl.load(cos_ptr + off, mask=on, other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + off, mask=on, other=0.0).to(tl.float32)
        y0 = x0 * c - x1 * s
        y1 = x0 * s + x1 * c
        x0 = y0.to(dtype).to(tl.float32)  # rounded as apply_rope_ writes it back
        x1 = y1.to(dtype).to(tl.float32)

    if ROTATE:
        y, r, exp = _rotate_round_tile(x0, x1, scale, amax_floor, inv_qmax, dtype, DIM, BF16_DOT, BLOCK_R,
                                       NUM_BLOCKS, QBLOCK)
        q_scale = (exp << 23).to(tl.float32, bitcast=True)
        out = tl.where(y < 0, -r, r) * q_scale
        j = tl.arange(0, DIM)
        optr = x_ptr + row_off[:, None] + j[None, :]
        tl.store(optr, out.to(dtype), mask=m2)
    else:
        tl.store(base, x0.to(dtype), mask=m2)
        tl.store(base + 1, x1.to(dtype), mask=m2)


def rope_rotate_round_(x: torch.Tensor, cos=None, sin=None, positions=None, rope_dim: int = 0,
                       rotate: bool = True) -> torch.Tensor:
    """In place on x [T, H, dim] (or [T, dim]; unit last stride, any token and head strides,
    bf16/fp16/fp32, dim a power of two >= 32): RoPE on the last rope_dim dims from the [max_pos, rope_dim/2] tables at
    positions [T] (skipped when rope_dim is 0), then with `rotate` the Hadamard rotation and
    the FP4 rounding per 32. Returns x."""
    x3 = x if x.dim() == 3 else x.unsqueeze(1)
    T, H, D = x3.shape
    if D < FP4_BLOCK or D & (D - 1) or D > 256:
        raise ValueError(f"rope_rotate_round_: dim {D} must be a power of two in [32, 256]")
    if x3.stride(-1) != 1:
        raise ValueError("rope_rotate_round_: x needs a unit last stride")
    if rope_dim % 2 or rope_dim > D or (rope_dim and (cos is None or positions is None)):
        raise ValueError(f"rope_rotate_round_: rope_dim {rope_dim} needs cos / sin / positions and must be "
                         f"even and <= {D}")
    R = T * H
    if R == 0:
        return x
    block_r = 32
    has_rope = rope_dim > 0
    _rope_rotate_round_kernel[(triton.cdiv(R, block_r),)](
        x3, x3.stride(0), x3.stride(1), cos if has_rope else x3, sin if has_rope else x3,
        cos.stride(0) if has_rope else 0, cos.stride(1) if has_rope else 0,
        positions if has_rope else x3, R, H, rope_dim, float(D) ** -0.5, AMAX_FLOOR, INV_E2M1_MAX,
        DIM=D, HAS_ROPE=has_rope, ROTATE=rotate, BF16_DOT=x.dtype == torch.bfloat16 and not _INTERPRET, BLOCK_R=block_r, NUM_BLOCKS=D // FP4_BLOCK,
        QBLOCK=FP4_BLOCK, num_warps=4, **pdl.options(x3))
    return x


@triton.jit
def _rotate_round_pack_kernel(x_ptr, stride_x, loc_ptr, pool_ptr, stride_pool, R, scale, amax_floor, inv_qmax,
                              DIM: tl.constexpr, BF16_DOT: tl.constexpr, BLOCK_R: tl.constexpr,
                              NUM_BLOCKS: tl.constexpr, QBLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Rows x [R, DIM] rotated and FP4-rounded as _rope_rotate_round_kernel does, stored packed
    (index_key_fp4.py: e2m1 code pairs, then one e8m0 byte per QBLOCK) at pool row loc[row];
    rows with loc -1 are not stored."""
    pdl.enter(PDL)
    HALF: tl.constexpr = DIM // 2
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    k = tl.arange(0, HALF)
    base = x_ptr + rows.to(tl.int64)[:, None] * stride_x + 2 * k[None, :]
    x0 = tl.load(base, mask=rmask[:, None], other=0.0).to(tl.float32)
    x1 = tl.load(base + 1, mask=rmask[:, None], other=0.0).to(tl.float32)
    y, r, exp = _rotate_round_tile(x0, x1, scale, amax_floor, inv_qmax, x_ptr.dtype.element_ty, DIM, BF16_DOT,
                                   BLOCK_R, NUM_BLOCKS, QBLOCK)
    # magnitude -> code of E2M1_VALUES (0, .5, 1, 1.5 -> 2r; 2, 3 -> r + 2; 4, 6 -> r / 2 + 4), then
    # y's sign bit: a negative value rounded to zero is -0.0, as the in-place rounding writes it
    code = tl.where(r < 2.0, 2.0 * r, tl.where(r < 4.0, r + 2.0, 0.5 * r + 4.0)).to(tl.int32)
    code = code | ((y.to(tl.int32, bitcast=True) < 0).to(tl.int32) << 3)
    lo, hi = tl.split(tl.reshape(code, [BLOCK_R, HALF, 2]))  # elements 2j, 2j + 1
    loc = tl.load(loc_ptr + rows, mask=rmask, other=-1).to(tl.int64)
    keep = (rmask & (loc >= 0))[:, None]
    prow = pool_ptr + loc[:, None] * stride_pool
    tl.store(prow + k[None, :], (lo | (hi << 4)).to(tl.uint8), mask=keep)
    scales = tl.max(tl.reshape(exp, [BLOCK_R, NUM_BLOCKS, QBLOCK]), 2)  # every lane of a block holds it
    tl.store(prow + HALF + tl.arange(0, NUM_BLOCKS)[None, :], scales.to(tl.uint8), mask=keep)


def rotate_round_pack_store(x: torch.Tensor, pool: torch.Tensor, out_loc: torch.Tensor) -> torch.Tensor:
    """pool[out_loc[e]] <- x[e] (rows [E, dim], unit last stride, bf16/fp16/fp32, dim a power of
    two in [32, 256]) Hadamard-rotated, FP4-rounded per 32 and packed in index_key_fp4's layout;
    out_loc -1 is skipped. The values are rope_rotate_round_'s (a -0.0 rotated value stays
    -0.0). One launch, static shapes, no host sync. Returns pool."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"rotate_round_pack_store: x must be [E, dim] rows with unit inner stride, got {tuple(x.shape)}")
    E, D = x.shape
    if D < FP4_BLOCK or D & (D - 1) or D > 256:
        raise ValueError(f"rotate_round_pack_store: dim {D} must be a power of two in [32, 256]")
    IndexKeyFP4Layout.of_rows(pool, D)
    if out_loc.shape != (E,):
        raise ValueError(f"rotate_round_pack_store: out_loc must be [{E}], got {tuple(out_loc.shape)}")
    if E == 0:
        return pool
    block_r = 32
    _rotate_round_pack_kernel[(triton.cdiv(E, block_r),)](
        x, x.stride(0), out_loc, pool, pool.stride(0), E, float(D) ** -0.5, AMAX_FLOOR, INV_E2M1_MAX,
        DIM=D, BF16_DOT=x.dtype == torch.bfloat16 and not _INTERPRET, BLOCK_R=block_r,
        NUM_BLOCKS=D // FP4_BLOCK, QBLOCK=FP4_BLOCK, num_warps=4, **pdl.options(x))
    return pool
