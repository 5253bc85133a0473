"""The step between an external MoE's two expert GEMMs, and the activation rounding before the
first, as one Triton launch each (the humming backend's glue: layers/moe/backends/humming.py).

- `quantize_rows(x)`: x [M, K] -> e4m3 [M, K] + fp32 power-of-two scales [M, K / 128],
  row-major (the layout a GEMM that takes per-row group scales reads), the values of
  quant_reference.quantize_fp8_blocks.
- `align_and_quantize(ids, E, block_m, x)`: moe_align's result (return_used) and
  quantize_rows(x) in one launch where moe_align runs in one kernel (decode and mid-size
  batches): the first programs sort the assignments and fill the padding (moe.align_program),
  the others round the rows.
- `swiglu_weight_quant(gu, weights, limit, act_dtype, fp8)`: gu [M, 2I] (gate | up halves, any
  float dtype) -> h = act_dtype(SwiGLU_clamped(gate, up) * weight[m]) computed in fp32, and with
  fp8 also rounded to e4m3 per 128 with its scales, exactly as quant_reference.fp4_moe_ref
  rounds the weighted activation before W2. Rows whose weight is 0 still produce finite output.

Graph-safe: static shapes, no host syncs; grids depend only on the tensor shapes.
"""

import torch
import triton
import triton.language as tl

from . import pdl
from .fp8_act_quant import INV_E4M3_MAX, e4m3_bits, pow2_recip, pow2_scale
from .host_math import cdiv, next_power_of_2
from .moe import AlignOneLaunch, align_one_applies, align_program, moe_align

QBLOCK = 128  # FP8 activation scale block
_TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _store_e4m3_blocks(x, q_row_ptr, s_row_ptr, offs, kb, mask, K, QB: tl.constexpr):
    """fp32 x [BLOCKS, QB] (blocks kb of one row) -> e4m3 bits at q_row_ptr + offs and the
    blocks' power-of-two scales at s_row_ptr + kb (quant_reference.quantize_fp8_blocks)."""
    scale = pow2_scale(tl.max(tl.abs(x), axis=1), INV_E4M3_MAX)
    v = tl.minimum(tl.maximum(x * pow2_recip(scale)[:, None], -448.0), 448.0)
    tl.store(q_row_ptr + offs, e4m3_bits(v), mask=mask)
    tl.store(s_row_ptr + kb, scale, mask=kb * QB < K)


@triton.jit
def _quant_row_blocks(x_ptr, q_ptr, s_ptr, m, kb0, K, stride_x, stride_q, stride_s,
                      BLOCKS: tl.constexpr, QB: tl.constexpr):
    """Row m's scale blocks kb0 .. kb0 + BLOCKS rounded (quantize_rows)."""
    kb = kb0 + tl.arange(0, BLOCKS)
    offs = kb[:, None] * QB + tl.arange(0, QB)[None, :]
    mask = offs < K
    x = tl.load(x_ptr + m * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    _store_e4m3_blocks(x, q_ptr + m * stride_q, s_ptr + m * stride_s, offs, kb, mask, K, QB)


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, stride_s,
                       BLOCKS: tl.constexpr, QB: tl.constexpr):
    _quant_row_blocks(x_ptr, q_ptr, s_ptr, tl.program_id(0).to(tl.int64), tl.program_id(1) * BLOCKS, K,
                      stride_x, stride_q, stride_s, BLOCKS, QB)


@triton.jit
def _align_quant_kernel(
    ids_ptr, sorted_ptr, block_expert_ptr, used_ptr, M, E, CAP, MAX_BLOCKS,
    x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, stride_s, align_programs, row_programs,
    BLOCK_M: tl.constexpr, MP: tl.constexpr, EP: tl.constexpr, FILL: tl.constexpr, FB: tl.constexpr,
    BLOCKS: tl.constexpr, QB: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    pid = tl.program_id(0)
    if pid < align_programs:
        align_program(pid, ids_ptr, sorted_ptr, block_expert_ptr, used_ptr, M, E, CAP, MAX_BLOCKS, BLOCK_M, MP,
                      EP, FILL, FB)
    else:
        r = pid - align_programs
        _quant_row_blocks(x_ptr, q_ptr, s_ptr, (r // row_programs).to(tl.int64), (r % row_programs) * BLOCKS, K,
                          stride_x, stride_q, stride_s, BLOCKS, QB)


@triton.jit
def _round_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), still fp32: by its bits, so the result is
    the same compiled and under the interpreter (whose fp32 -> bf16 cast truncates)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # 0xFFFF0000 as an int32
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _swiglu_quant_kernel(gu_ptr, w_ptr, h_ptr, s_ptr, I, stride_gu, stride_h, stride_s, limit,
                         ACT_DTYPE: tl.constexpr, HAS_LIMIT: tl.constexpr, FP8: tl.constexpr,
                         BLOCKS: tl.constexpr, QB: tl.constexpr, PDL: tl.constexpr = False):
    pdl.enter(PDL)
    m = tl.program_id(0).to(tl.int64)
    kb = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    offs = kb[:, None] * QB + tl.arange(0, QB)[None, :]
    mask = offs < I
    g = tl.load(gu_ptr + m * stride_gu + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + m * stride_gu + I + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_LIMIT:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    w = tl.load(w_ptr + m).to(tl.float32)
    # rounded to the activation dtype first, as the reference rounds before its FP8 step
    h = g / (1.0 + tl.exp(-g)) * u * w
    if ACT_DTYPE == tl.bfloat16:
        h = _round_bf16(h)
    h = h.to(ACT_DTYPE)
    if FP8:  # h viewed as uint8
        _store_e4m3_blocks(h.to(tl.float32), h_ptr + m * stride_h, s_ptr + m * stride_s, offs, kb,
                           mask, I, QB)
    else:
        tl.store(h_ptr + m * stride_h + offs, h, mask=mask)


def _blocks_per_program(K: int) -> int:
    return min(8, next_power_of_2(cdiv(K, QBLOCK)))


def quantize_rows(x: torch.Tensor, q: torch.Tensor | None = None, s: torch.Tensor | None = None):
    """x [M, K] (K % 128 == 0) -> (e4m3 [M, K], fp32 scales [M, K / 128] row-major); q and s may
    be given (preallocated outputs)."""
    M, K = x.shape
    if K % QBLOCK or x.stride(-1) != 1:
        raise ValueError(f"quantize_rows: x [{M}, {K}] needs K % {QBLOCK} == 0 and unit stride")
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device) if q is None else q
    s = torch.empty(M, K // QBLOCK, dtype=torch.float32, device=x.device) if s is None else s
    if M:
        blocks = _blocks_per_program(K)
        _quant_rows_kernel[(M, cdiv(K // QBLOCK, blocks))](
            x, q.view(torch.uint8), s, K, x.stride(0), q.stride(0), s.stride(0), BLOCKS=blocks,
            QB=QBLOCK, num_warps=4)
    return q, s


def align_and_quantize(ids: torch.Tensor, num_experts: int, block_m: int, x: torch.Tensor):
    """((sorted_ids, block_expert, used) = moe_align(ids, num_experts, block_m, return_used=True),
    (q, s) = quantize_rows(x)): one launch where moe_align runs in one kernel, else the two."""
    M, K = x.shape
    if not align_one_applies(ids) or M == 0 or K % QBLOCK or x.stride(-1) != 1:
        return moe_align(ids, num_experts, block_m, return_used=True), quantize_rows(x)
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(M, K // QBLOCK, dtype=torch.float32, device=x.device)
    blocks = _blocks_per_program(K)
    row_programs = cdiv(K // QBLOCK, blocks)
    launch = AlignOneLaunch.of(ids, num_experts, block_m)
    _align_quant_kernel[(launch.programs + M * row_programs,)](
        *launch.args, x, q.view(torch.uint8), s, K, x.stride(0), q.stride(0), s.stride(0), launch.programs,
        row_programs,
        **launch.constexprs, BLOCKS=blocks, QB=QBLOCK, num_warps=launch.num_warps, **pdl.options(x))
    return launch.outputs, (q, s)


def swiglu_weight_quant(gu: torch.Tensor, weights: torch.Tensor, limit: float,
                        act_dtype: torch.dtype, fp8: bool, h: torch.Tensor | None = None,
                        s: torch.Tensor | None = None):
    """gu [M, 2I], weights [M] -> (h [M, I], scales [M, I / 128] or None): see the module
    docstring. h is e4m3 with fp8, act_dtype otherwise."""
    M, two_i = gu.shape
    I = two_i // 2
    if two_i % 2 or (fp8 and I % QBLOCK) or gu.stride(-1) != 1 or weights.numel() != M:
        raise ValueError(f"swiglu_weight_quant: gu [{M}, {two_i}], weights {tuple(weights.shape)}"
                         f" (fp8 needs I % {QBLOCK} == 0)")
    if h is None:
        h = torch.empty(M, I, dtype=torch.float8_e4m3fn if fp8 else act_dtype, device=gu.device)
    if fp8 and s is None:
        s = torch.empty(M, I // QBLOCK, dtype=torch.float32, device=gu.device)
    if M:
        blocks = _blocks_per_program(I)
        _swiglu_quant_kernel[(M, cdiv(cdiv(I, QBLOCK), blocks))](
            gu, weights.reshape(-1), h.view(torch.uint8) if fp8 else h, s if fp8 else h, I,
            gu.stride(0), h.stride(0), s.stride(0) if fp8 else 0, float(limit),
            ACT_DTYPE=_TL_DTYPE[act_dtype], HAS_LIMIT=limit > 0, FP8=fp8,
            BLOCKS=blocks, QB=QBLOCK, num_warps=4, **pdl.options(gu))
    return h, (s if fp8 else None)
