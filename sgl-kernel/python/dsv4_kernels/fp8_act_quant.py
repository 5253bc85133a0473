"""FP8 activation quantization per 128 along K (release numerics): e4m3 bytes and fp32
power-of-two scales (`quantize_act`, quant_reference.quantize_fp8_blocks bit for bit), or the
values rounded to FP8 in place of x (`round_act`), and the Triton helpers the GEMMs inline to
quantize inside their own kernels. Used by the Triton FP8 GEMM (fp8_gemm.py), the cuBLAS one
(fp8_scaled_mm.py), and the MoE activations (moe_act.py, fp4_moe.py).

The fp32 -> e4m3 rounding is done with integer ops (`e4m3_bits`), not a cast: Triton's
interpreter rounds that cast wrongly (-127.99 -> -64), and the bits are then the same on both.
"""

import torch
import triton
import triton.language as tl

from .host_math import cdiv, next_power_of_2

QBLOCK = 128  # activation quantization block along K (pow2_scale floors amax at 1e-4, as
# quant_reference.AMAX_FLOOR does)
INV_E4M3_MAX = tl.constexpr(1.0 / 448.0)  # rounded to fp32 where used, as torch does


@triton.jit
def pow2_scale(amax, INV_QMAX: tl.constexpr):
    """quant_reference.pow2_scale: the power of two >= max(amax, 1e-4) * fp32(1/qmax)."""
    s = tl.maximum(amax, 1e-4) * INV_QMAX
    bits = s.to(tl.int32, bitcast=True)
    exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return (exp << 23).to(tl.float32, bitcast=True)


@triton.jit
def pow2_recip(scale):
    """1 / scale for a normal fp32 power of two, exactly (from its exponent bits): a multiply
    by it is exact, where fp32 division on the GPU is an approximation."""
    exp = (scale.to(tl.int32, bitcast=True) >> 23) & 0xFF
    return ((254 - exp) << 23).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_bits(v):
    """fp32 v with |v| <= 448 -> the uint8 bits of e4m3(v), round to nearest even."""
    a = tl.abs(v)
    bits = a.to(tl.int32, bitcast=True)
    rb = bits + 0x7FFFF + ((bits >> 20) & 1)  # RNE to 3 mantissa bits
    normal = (((rb >> 23) - 120) << 3) | ((rb >> 20) & 7)  # rebias 127 -> 7
    # Below 2^-6 e4m3 is subnormal (multiples of 2^-9): the fp32 add rounds to that grid.
    sub = (((a + 24576.0) - 24576.0) * 512.0).to(tl.int32)
    code = tl.where(a >= 0.015625, normal, sub)
    return (code | ((v < 0).to(tl.int32) << 7)).to(tl.uint8)


@triton.jit
def _act_quant_kernel(
    x_ptr, q_ptr, s_ptr, M, K, stride_x, stride_q, stride_sm, stride_sk,
    BLOCKS: tl.constexpr, QB: tl.constexpr, ROUND_ONLY: tl.constexpr,
):
    """Row m, K blocks [j*BLOCKS, (j+1)*BLOCKS): e4m3 bits and fp32 pow2 scales, or
    (ROUND_ONLY) the dequantized values in q's dtype (exact: e4m3 x a power of two). Rows
    m >= M (padding the grid may add) quantize zeros: e4m3 0 with the floor's scale."""
    m = tl.program_id(0).to(tl.int64)
    kb = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    offs = kb[:, None] * QB + tl.arange(0, QB)[None, :]
    mask = offs < K
    # Padding rows read row M-1 (the load and its mask stay those of a real row) and zero it.
    x = tl.load(x_ptr + tl.minimum(m, M - 1) * stride_x + offs, mask=mask, other=0.0)
    x = tl.where(m < M, x.to(tl.float32), 0.0)
    scale = pow2_scale(tl.max(tl.abs(x), axis=1), INV_E4M3_MAX)
    v = tl.minimum(tl.maximum(x * pow2_recip(scale)[:, None], -448.0), 448.0)
    if ROUND_ONLY:
        r = e4m3_bits(v).to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, None]
        tl.store(q_ptr + m * stride_q + offs, r.to(q_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(q_ptr + m * stride_q + offs, e4m3_bits(v), mask=mask)
        tl.store(s_ptr + m * stride_sm + kb * stride_sk, scale, mask=kb * QB < K)


def quantize_act(x2: torch.Tensor, rows: int | None = None):
    """x [M, K] (K % 128 == 0) -> (e4m3 [R, K], fp32 scales [R, K/128]), R = rows or M. The
    scales are a transposed view (strides (1, R)): the GEMMs read one K block's scales for many
    rows at a time, and these lie together (cuBLAS's 1 x 128 layout too). Consumers must use
    both strides. Rows M..R-1 (rows > M pads for cuBLAS) hold zeros with finite scales."""
    M, K = x2.shape
    R = M if rows is None else rows
    if R < M or (R and not M):
        raise ValueError(f"quantize_act: rows={rows} is fewer than x's {M} (or x has none)")
    q = torch.empty(R, K, dtype=torch.uint8, device=x2.device)
    s = torch.empty(K // QBLOCK, R, dtype=torch.float32, device=x2.device).t()
    if R:
        blocks = min(8, next_power_of_2(K // QBLOCK))
        _act_quant_kernel[(R, cdiv(K // QBLOCK, blocks))](
            x2, q, s, M, K, x2.stride(0), q.stride(0), s.stride(0), s.stride(1), BLOCKS=blocks,
            QB=QBLOCK, ROUND_ONLY=False, num_warps=4)
    return q.view(torch.float8_e4m3fn), s


def round_act(x2: torch.Tensor) -> torch.Tensor:
    """x [M, K] (K % 128 == 0) -> quant_reference.fp8_round_blocks(x), x's dtype."""
    M, K = x2.shape
    r = torch.empty(M, K, dtype=x2.dtype, device=x2.device)
    if M:
        blocks = min(8, next_power_of_2(K // QBLOCK))
        _act_quant_kernel[(M, cdiv(K // QBLOCK, blocks))](
            x2, r, r, M, K, x2.stride(0), r.stride(0), 0, 0, BLOCKS=blocks, QB=QBLOCK,
            ROUND_ONLY=True, num_warps=4)
    return r
