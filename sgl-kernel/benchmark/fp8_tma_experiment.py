"""Experiment, timed by bench_quant.py --quick only (not used by the model): the release FP8
block GEMM with its e4m3 tiles loaded by TMA (host tensor descriptors) instead of pointer
loads, at 128 x 128 tiles. Same math as fp8_gemm._fp8_gemm_kernel (no split-K, x quantized by
quantize_act); bench_quant checks its output against ops.fp8_block_linear before timing it.
Written without a GPU: whether Triton 3.6 lowers it to TMA and whether it is faster is what
the bench row (fp8_release_tma) shows."""

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from dsv4_kernels.fp8_act_quant import quantize_act
from dsv4_kernels.fp8_gemm import _tile_ids


@triton.jit
def _fp8_gemm_tma_kernel(
    a_desc, as_ptr, b_desc, bs_ptr, c_ptr, M, N, K, stride_asm, stride_ask, stride_bsn,
    stride_cm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    m0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    bs_row = bs_ptr + (n0 // 128) * stride_bsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(0, K // 128):
        a = a_desc.load([m0, kb * 128])
        b = b_desc.load([n0, kb * 128])
        sa = tl.load(as_ptr + offs_m * stride_asm + kb * stride_ask, mask=m_mask, other=0.0)
        sb = tl.load(bs_row + kb)
        acc += tl.dot(a, b.T) * (sa * sb)[:, None]
    c = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & (offs_n < N)[None, :])


def fp8_linear_tma(x2, weight, weight_scale, block_m=128, block_n=128, num_warps=8,
                   num_stages=4):
    """bf16 x [M, K] (K % 128 == 0) -> bf16 [M, N], release numerics."""
    M, K = x2.shape
    N = weight.shape[0]
    q, s = quantize_act(x2)
    out = torch.empty(M, N, dtype=x2.dtype, device=x2.device)
    ws = weight_scale.float().contiguous()
    a_desc = TensorDescriptor.from_tensor(q, [block_m, 128])
    b_desc = TensorDescriptor.from_tensor(weight, [block_n, 128])
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n),)
    _fp8_gemm_tma_kernel[grid](a_desc, s, b_desc, ws, out, M, N, K, s.stride(0), s.stride(1),
                               ws.stride(0), out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n,
                               GROUP_M=8, num_warps=num_warps, num_stages=num_stages)
    return out
