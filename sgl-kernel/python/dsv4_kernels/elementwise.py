"""Triton kernels for the row-wise glue between a layer's GEMMs: the RMS norms, the shared
expert's clamped SwiGLU and the MoE's shared + routed sum.

In torch each of these is a chain of fp32 temporaries: an RMSNorm is eight kernels (upcast,
square, mean, add, rsqrt, two broadcast multiplies, downcast), each a full pass over [T, d] in
fp32. At a Flash-dims 4096-token step those chains were about a fifth of a layer's GPU time
(docs/benchmarks.md §3). Here each is one pass: read the 16-bit inputs once, fp32 math in
registers, write the result once in its final dtype. The math follows reference.py operation
for operation, so only the order of the fp32 sum of squares differs from torch's.

Shapes are static and nothing syncs: graph capturable.
"""

import torch
import triton
import triton.language as tl


def _row_block(d: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for one program per row of d elements: the whole row in registers
    (d <= 16384 here: hidden 4096 and q_lora 1024 at Flash), about 16 elements per thread."""
    block = triton.next_power_of_2(d)
    return block, max(1, min(16, block // 512))


@triton.jit
def _rms_norm_kernel(x_ptr, stride_x, w_ptr, out_ptr, stride_out, D, eps,
                     HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, 0) / D + eps)
    if HAS_WEIGHT:
        y = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32) * y
    tl.store(out_ptr + row * stride_out + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as 2-D [rows, d] with unit stride along d (a view where x's layout allows one)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """(weight * x * rsqrt(mean(x^2) + eps)) in x's dtype, fp32 math, over the last dim of x
    [..., d]; weight [d] (any float dtype) or None. Writes `out` (x's shape) if given."""
    d = x.shape[-1]
    if weight is not None and weight.shape != (d,):
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} does not match the last dim {d}")
    x2 = _rows(x)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.shape != x.shape or out.stride(-1) != 1:
        raise ValueError(f"rms_norm: out must have x's shape {tuple(x.shape)} and a unit last stride")
    out2 = out.view(-1, d)
    if x2.shape[0] == 0:
        return out
    block, warps = _row_block(d)
    _rms_norm_kernel[(x2.shape[0],)](
        x2, x2.stride(0), weight if weight is not None else x2, out2, out2.stride(0), d, float(eps),
        HAS_WEIGHT=weight is not None, BLOCK=block, num_warps=warps)
    return out


@triton.jit
def _swiglu_kernel(gate_ptr, stride_g, up_ptr, stride_u, out_ptr, stride_out, D, limit,
                   HAS_LIMIT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    g = tl.load(gate_ptr + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_u + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_LIMIT:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * stride_out + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def swiglu_clamped(gate: torch.Tensor, up: torch.Tensor, limit: float, out_dtype: torch.dtype) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit) in fp32 (no clamp when limit <= 0),
    written once in out_dtype; gate and up [T, n] (may be column slices of one buffer)."""
    if gate.shape != up.shape or gate.dim() != 2:
        raise ValueError(f"swiglu_clamped: gate {tuple(gate.shape)} and up {tuple(up.shape)} must be one 2-D shape")
    if gate.stride(-1) != 1 or up.stride(-1) != 1:
        raise ValueError("swiglu_clamped: gate and up need a unit last stride")
    T, n = gate.shape
    out = torch.empty((T, n), dtype=out_dtype, device=gate.device)
    if T == 0:
        return out
    block = min(1024, triton.next_power_of_2(n))
    _swiglu_kernel[(T, triton.cdiv(n, block))](
        gate, gate.stride(0), up, up.stride(0), out, out.stride(0), n, float(limit),
        HAS_LIMIT=limit > 0, BLOCK=block, num_warps=4)
    return out


@triton.jit
def _add_kernel(a_ptr, stride_a, b_ptr, stride_b, out_ptr, stride_out, D, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    a = tl.load(a_ptr + row * stride_a + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + row * stride_b + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (a + b).to(out_ptr.dtype.element_ty), mask=mask)


def add_fp32(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """(a.float() + b.float()) rounded once to out_dtype; a and b [T, n], any float dtypes."""
    if a.shape != b.shape or a.dim() != 2:
        raise ValueError(f"add_fp32: a {tuple(a.shape)} and b {tuple(b.shape)} must be one 2-D shape")
    a, b = (t if t.stride(-1) == 1 else t.contiguous() for t in (a, b))
    T, n = a.shape
    out = torch.empty((T, n), dtype=out_dtype, device=a.device)
    if T == 0:
        return out
    block = min(1024, triton.next_power_of_2(n))
    _add_kernel[(T, triton.cdiv(n, block))](a, a.stride(0), b, b.stride(0), out, out.stride(0), n,
                                            BLOCK=block, num_warps=4)
    return out
