"""bf16 linear with fp32 sums for one row (decode): the products the model keeps in fp32.

Three linears of a decode layer take bf16 x and want fp32 results: the compressors' wkv + wgate
(fp32 weights held exactly as three bf16 terms, tensor_core_gemm.split_weight: [x, x, x] times
[w_hi | w_lo | w_lo2]), the router's logits and the indexer's head weights. At one row cuBLAS
runs each as a split-K GEMM plus its reduction (plus a concatenation of x for the split
weight, and a cast and a scale for the head weights): three or four launches where the bytes
take a few microseconds. Here each is one launch of a GEMV on the CUDA cores: a program owns
BLOCK_N weight rows and walks all REPEAT * K columns in BLOCK_K slabs, reading x's slab
k % K (x repeated along K, as split_linear's operand repeats it).

Numerics: a bf16 x bf16 product is exact in fp32, so the result is the fp32 GEMM's up to
the order of its fp32 sums (fixed here: no split-K, deterministic). round_bf16 rounds each
sum to bf16 before the scale, as a bf16 nn.Linear followed by `.float() * scale` does.
Graph-safe: no host syncs; the grid depends only on shapes.
"""

import torch
import triton
import triton.language as tl

from . import pdl
from .host_math import cdiv, next_power_of_2

DISPATCH_ROWS = 1  # ops.bf16_gemv_takes: the rows sent here (cuBLAS keeps the rest)
# Weights per program tile, and programs the rows are spread over at least (one H200 wave).
_TILE = 8192
_MIN_PROGRAMS = 128


@triton.jit
def _bf16_gemv_kernel(
    x_ptr, w_ptr, out_ptr, N, K, KW, stride_w, scale,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROUND_BF16: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows_w = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, KW, BLOCK_K):  # BLOCK_K divides K: a slab lies in one term
        w = tl.load(rows_w + (k0 + offs_k)[None, :], mask=n_mask[:, None], other=0.0).to(tl.float32)
        x = tl.load(x_ptr + k0 % K + offs_k).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    if ROUND_BF16:
        acc = acc.to(tl.bfloat16).to(tl.float32)
    tl.store(out_ptr + offs_n, acc * scale, mask=n_mask)


def fits(rows: int, K: int, KW: int) -> bool:
    """Whether the kernel takes a call: DISPATCH_ROWS rows, a weight of whole repeats of K,
    and K a multiple of a slab (a power of two from 128 on)."""
    return 0 < rows <= DISPATCH_ROWS and K > 0 and KW % K == 0 and K % _slab(K) == 0


def _slab(K: int) -> int:
    return max(128, min(2048, next_power_of_2(K)))


def gemv_config(N: int, K: int) -> dict:
    """Slabs of up to 2048 columns; rows per program so that at least _MIN_PROGRAMS programs
    share the weight, within a tile of _TILE weights."""
    block_k = _slab(K)
    block_n = 1
    while block_n * 2 * block_k <= _TILE and cdiv(N, block_n * 2) >= _MIN_PROGRAMS:
        block_n *= 2
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)


def bf16_gemv(x: torch.Tensor, weight: torch.Tensor, scale: float = 1.0, round_bf16: bool = False,
              config: dict | None = None) -> torch.Tensor:
    """x [..., K] bf16 (one row) @ weight bf16 [N, R * K]^T with x repeated R times along K
    -> fp32 [..., N] (rounded to bf16 first with round_bf16), times scale."""
    K = x.shape[-1]
    N, KW = weight.shape
    rows = x.numel() // K if K else 0
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or weight.stride(-1) != 1:
        raise ValueError(f"bf16_gemv: needs bf16 x and a row-major bf16 weight, got {x.dtype} and "
                         f"{weight.dtype} strides {weight.stride()}")
    if not fits(rows, K, KW):
        raise ValueError(f"bf16_gemv: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not fit "
                         f"({DISPATCH_ROWS} row(s), weight columns a multiple of K, K a multiple of its slab)")
    x1 = x.reshape(K)
    if x1.stride(0) != 1:
        x1 = x1.contiguous()
    out = torch.empty(*x.shape[:-1], N, dtype=torch.float32, device=x.device)
    cfg = config or gemv_config(N, K)
    _bf16_gemv_kernel[(cdiv(N, cfg["BLOCK_N"]),)](
        x1, weight, out, N, K, KW, weight.stride(0), float(scale),
        BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], ROUND_BF16=round_bf16, num_warps=cfg["num_warps"],
        **pdl.options(x1))
    return out
