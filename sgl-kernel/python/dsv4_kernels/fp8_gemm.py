"""Triton FP8 block-scaled linear: y = x @ dequant(W)^T with W e4m3 [N, K] and one fp32
power-of-two scale per 128x128 block (quant_reference.fp8_block_linear_ref's contract).

act_quant (release numerics): a small kernel quantizes x per 128 along K (e4m3 bytes + fp32
pow2 scales, quant_reference.quantize_fp8_blocks bit for bit), then the GEMM multiplies e4m3 x
e4m3 on the FP8 tensor cores one 128-wide K block at a time and adds the fp32 partial times
(act scale x weight block scale) into an fp32 accumulator; at M <= 16 the quantization runs
inside the GEMM instead. fp32 x is the exception: rounded to FP8 values in fp32 and multiplied
by the weight-only kernel in fp32 (exact products, fp32 sums, like the reference).
Weight-only: e4m3 tiles are converted to x's dtype with their block scale (exact) and
multiplied with tl.dot, fp32 accumulation. Small M splits K across programs (fp32 workspace,
summed by a second kernel in a fixed order: deterministic, no atomics).

Decode sizes on CUDA, by measurement at Flash's seven FP8 linear shapes and wo_a on an H200
(sgl-kernel/benchmark/bench_small_m_linears.py, each GEMM alone as a graph replay):
- one row takes fp8_gemv's weight-streaming GEMV: 1.2-2.8x cuBLAS, 1.3-1.7x these kernels;
- 2..16 rows take these kernels with the quantization fused: 1.1-1.8x cuBLAS on five shapes,
  even on wq_b and wo_b, 7% behind on the indexer's wq_b (cuBLAS's ~18 µs floor at small M);
  the GEMV's per-row work makes it lose from two rows on;
- 17..64 rows take these kernels after a separate quantization launch (H100, same benchmark,
  `--m 16 32 64`): at 64 rows 1.2-1.5x cuBLAS at wq_a, wkv and the shared gate/up, 1.1x at
  wo_b, 2-6% behind at wq_b and the shared down, 21% behind at the indexer's wq_b alone; as one
  stacked weight (Fp8RowStack) wq_a + wkv take 15.0 µs against cuBLAS's 19.0 + 19.5 apart and
  wq_b + the indexer's wq_b 29.5 against 25.9 + 13.0.
Release numerics on bf16/fp16 x from 65 rows up go to cuBLAS instead (fp8_scaled_mm: torch's
scaled GEMM with the same block scales, 1.5-2.6x faster on an H200 at prefill sizes) where the
device supports it; `backend` forces either path.

Graph-safe: no host syncs; the tiles, the split and the buffers depend only on shapes (a small
table, `gemm_config`, instead of autotuning, which would launch many configs at capture).
The fp32 -> e4m3 rounding is done with integer ops (`e4m3_bits`), not a cast: Triton's
interpreter rounds that cast wrongly (-127.99 -> -64), and the bits are then the same on both.
"""

import torch
import triton
import triton.language as tl

from . import fp8_gemv, fp8_scaled_mm
from ._dot import dot_precision
from .elementwise import add_fp32, rms_norm, swiglu_clamped
from .mhc import hc_post
from .moe import RoutedRows
from .fp8_act_quant import INV_E4M3_MAX, QBLOCK, e4m3_bits, pow2_recip, pow2_scale, quantize_act, round_act
from .host_math import cdiv, sm_count

SMALL_M_ROWS = 64  # auto: up to this many rows the Triton GEMM, not cuBLAS (module doc)


@triton.jit
def _tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # Grouped order: GROUP_M row tiles share each weight column tile while it sits in L2.
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    return pid_m, pid_n


@triton.jit
def _fp8_gemm_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K, KB_PER_SPLIT,
    stride_am, stride_asm, stride_ask, stride_bn, stride_bsn, stride_cs, stride_cm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
    QUANT_A: tl.constexpr,
):
    """c[split] = sum over this split's 128-blocks kb of (a_kb . b_kb) * as[m,kb] * bs[n/128,kb].
    QUANT_A: a is x itself (bf16/fp16) and each 128-block is quantized here, as _act_quant_kernel
    does (M <= 16: saves a launch; every N tile repeats the few rows' quantization).
    BLOCK_N divides 128, so a tile has one weight scale per K block (a scalar load), and the
    two scales fold into one per-row factor before they touch the [BM, BN] partial: a single
    FMA per accumulator element per block, and fewer live registers."""
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    split = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, 128)
    m_mask = offs_m < M
    n_mask = offs_n < N
    rows = offs_m.to(tl.int64)
    cols = offs_n.to(tl.int64)
    num_kb = K // 128
    bs_row = bs_ptr + ((pid_n * BLOCK_N) // 128) * stride_bsn
    kb0 = split * KB_PER_SPLIT
    kb1 = tl.minimum(kb0 + KB_PER_SPLIT, num_kb)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(kb0, kb1):
        k = kb * 128 + offs_k
        a = tl.load(a_ptr + rows[:, None] * stride_am + k[None, :], mask=m_mask[:, None], other=0.0)
        b = tl.load(b_ptr + cols[None, :] * stride_bn + k[:, None], mask=n_mask[None, :], other=0.0)
        if QUANT_A:
            xa = a.to(tl.float32)
            sa = pow2_scale(tl.max(tl.abs(xa), axis=1), INV_E4M3_MAX)
            va = tl.minimum(tl.maximum(xa * pow2_recip(sa)[:, None], -448.0), 448.0)
            a = e4m3_bits(va).to(tl.float8e4nv, bitcast=True)
        else:
            # quantize_act stores the scales K-block-major: this load is coalesced.
            sa = tl.load(as_ptr + rows * stride_asm + kb * stride_ask, mask=m_mask, other=0.0)
        sb = tl.load(bs_row + kb)
        # The 128-deep e4m3 dot is exact-product fp32; the scales are applied once per block
        # (sa * sb: a product of powers of two, exact).
        acc += tl.dot(a, b) * (sa * sb)[:, None]
    c = c_ptr + split * stride_cs + rows[:, None] * stride_cm + cols[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _wo_gemm_kernel(
    a_ptr, b_ptr, bs_ptr, c_ptr, M, N, K, K_PER_SPLIT,
    stride_am, stride_bn, stride_bsn, stride_cs, stride_cm,
    stride_ag, stride_bg, stride_bsg, stride_cg,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Weight-only: c[split] = a . (b * bs) over this split's K range, b converted to a's dtype
    (exact: an e4m3 value times a power of two). BLOCK_K and BLOCK_N divide 128, so one tile of
    b has one scale (a scalar load). Grid axis 2 is a group of a block-diagonal product
    (fp8_grouped_linear): group g offsets a, b, bs and c by g times their stride_*g (all 0 for
    one plain GEMM)."""
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    split = tl.program_id(1)
    g = tl.program_id(2).to(tl.int64)
    a_ptr += g * stride_ag
    b_ptr += g * stride_bg
    bs_ptr += g * stride_bsg
    c_ptr += g * stride_cg
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    rows = offs_m.to(tl.int64)
    cols = offs_n.to(tl.int64)
    bs_row = bs_ptr + ((pid_n * BLOCK_N) // 128) * stride_bsn
    k_lo = split * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < k_hi
        a = tl.load(a_ptr + rows[:, None] * stride_am + k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptr + cols[None, :] * stride_bn + k[:, None],
                    mask=n_mask[None, :] & k_mask[:, None], other=0.0)
        sb = tl.load(bs_row + k0 // 128)
        b = (b.to(tl.float32) * sb).to(a.dtype)
        acc = tl.dot(a, b, acc, input_precision=DOT_PREC)
    c = c_ptr + split * stride_cs + rows[:, None] * stride_cm + cols[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _split_sum_kernel(ws_ptr, out_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(SPLIT):  # fixed order: deterministic
        acc += tl.load(ws_ptr + s * MN + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def gemm_config(M: int, N: int, K: int, act_quant: bool, num_sms: int = 132) -> dict:
    """Tiles by shape (no autotuning: graph capture must not launch candidate configs).

    M <= 16: 16 x 64 tiles; M <= 64: 64 x 64; M <= 256: 64 x 128; larger: 64 x 128 for FP8
    (measured below), 128 x 128 (8 warps) for weight-only.
    BLOCK_N always divides 128 (one weight scale per tile and K block). FP8 with M <= 16
    quantizes the activations inside the GEMM (fuse_quant: one launch fewer); at M = 64 the
    H200 showed the repeated per-N-tile quantization costing 2.5x the GEMM (wq_b: 65 us fused
    vs 24 us weight-only), so from 17 rows on x is quantized once by its own kernel.
    128 x 256 spills for FP8 (the per-block partial doubles the accumulator registers). K step:
    128 for FP8 (one scale block per dot), 64 for weight-only. While the tiles leave SMs idle
    (fewer than 2 waves' worth), K is split across programs up to 2 waves and at least 4 K
    steps per split (bandwidth-bound small M: every SM must stream weights)."""
    if M <= 16:
        bm, bn, warps, stages = 16, 64, 4, 4
    elif M <= 64:
        bm, bn, warps, stages = 64, 64, 4, 4
    elif M <= 256:
        bm, bn, warps, stages = 64, 128, 4, 4
    elif act_quant:
        # 64 x 128 x 4 warps beat 128 x 128 x 8 warps on all six Flash shapes at M 2048 and 8192
        # on the H200 (1.03-1.61x; bench_quant.py --quick's fp8_release_128x128 rows, the
        # release-format suite's bench_quant_quick item): two CTAs share an SM, so one's
        # per-block rescale overlaps the other's tensor-core work.
        bm, bn, warps, stages = 64, 128, 4, 4
    else:
        bm, bn, warps, stages = 128, 128, 8, 4
    bk = 128 if act_quant else 64
    steps = cdiv(K, bk)
    tiles = cdiv(M, bm) * cdiv(N, bn)
    split = 1
    if tiles < 2 * num_sms:
        split = max(1, min((2 * num_sms) // tiles, steps // 4))
    steps_per_split = cdiv(steps, split)
    split = cdiv(steps, steps_per_split)  # no empty splits
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages,
                split=split, steps_per_split=steps_per_split, fuse_quant=act_quant and M <= 16)


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, out_ptr, N, K, stride_w, stride_sn, stride_out,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < N)[:, None] & (cols < K)[None, :]
    w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * stride_w + cols[None, :], mask=mask, other=0.0)
    # the scale in the output dtype first, then one fp32 product rounded once: torch's
    # weight.to(dtype) * scale.to(dtype) (a bf16 multiply is an fp32 one rounded)
    s = tl.load(s_ptr + (rows // 128)[:, None] * stride_sn + (cols // 128)[None, :], mask=mask, other=0.0)
    s = s.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :],
             (w.to(tl.float32) * s).to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """quant_reference.dequantize_fp8_block in one pass: e4m3 [N, K] x its fp32 scale per
    128 x 128 block -> `dtype` [N, K] (fp32 or bf16; bf16 exact while the scales are powers of
    two). torch's chain is an upcast copy and a broadcast multiply, both over the output."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dequantize_weight: dtype must be float32 or bfloat16, got {dtype}")
    N, K = weight.shape
    if scale.shape != (cdiv(N, 128), cdiv(K, 128)) or weight.stride(-1) != 1 or scale.stride(-1) != 1:
        raise ValueError(f"dequantize_weight: weight {tuple(weight.shape)} needs a unit last stride and "
                         f"scales [{cdiv(N, 128)}, {cdiv(K, 128)}], got {tuple(scale.shape)}")
    out = torch.empty(N, K, dtype=dtype, device=weight.device)
    if N and K:
        _dequant_kernel[(cdiv(N, 32), cdiv(K, 128))](
            weight, scale, out, N, K, weight.stride(0), scale.stride(0), out.stride(0),
            BLOCK_N=32, BLOCK_K=128, num_warps=4)
    return out


def fp8_block_linear(x, weight, weight_scale, act_quant: bool, config: dict | None = None,
                     backend: str = "auto", cublas_scale: torch.Tensor | None = None):
    """x [..., K] -> x.dtype [..., N] (quant_reference.fp8_block_linear_ref's contract).

    backend: "auto" takes cuBLAS (fp8_scaled_mm) where `fp8_scaled_mm.use_cublas` allows it
    (release numerics, bf16/fp16 x, whole 128-blocks, a device that passed the probe) and these
    Triton kernels otherwise; "triton" / "cublas" force one ("cublas" raises ValueError naming
    why it cannot run). A `config` (Triton tiles) implies Triton. cublas_scale: the weight's
    scales in cuBLAS's layout (fp8_scaled_mm.weight_scale_layout), built once by the caller;
    None builds it per call (a view, no copy, when K/128 % 4 == 0)."""
    N, K = weight.shape
    if x.shape[-1] != K:
        raise ValueError(f"fp8_block_linear: x has K={x.shape[-1]}, weight {tuple(weight.shape)}")
    if weight.dtype != torch.float8_e4m3fn or weight.stride(-1) != 1:
        raise TypeError(f"fp8_block_linear: weight must be row-major float8_e4m3fn, got "
                        f"{weight.dtype} strides {weight.stride()}")
    if tuple(weight_scale.shape) != (cdiv(N, 128), cdiv(K, 128)):
        raise ValueError(f"fp8_block_linear: weight_scale {tuple(weight_scale.shape)} for "
                         f"weight {(N, K)}")
    if act_quant and K % QBLOCK:
        raise ValueError(f"fp8_block_linear: act_quant needs K % 128 == 0, got K={K}")
    if backend not in fp8_scaled_mm.BACKENDS:
        raise ValueError(f"fp8_block_linear: backend must be one of {fp8_scaled_mm.BACKENDS}, "
                         f"got {backend!r}")
    if config is not None and backend == "cublas":
        raise ValueError("fp8_block_linear: a Triton tile config was given with backend='cublas'")
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    if backend == "auto" and config is None and x2.is_cuda and M <= fp8_gemv.DISPATCH_ROWS \
            and fp8_gemv.fits(M, K, x2.dtype):
        return fp8_gemv.fp8_gemv(x2, weight, weight_scale, act_quant).view(*x.shape[:-1], N)
    # up to SMALL_M_ROWS rows the fused-quantization Triton GEMM beat cuBLAS (see the module doc)
    small = backend == "auto" and M <= SMALL_M_ROWS
    if M and fp8_scaled_mm.use_cublas(x2, weight, act_quant, "triton" if config or small else backend):
        scale_b = (fp8_scaled_mm.weight_scale_layout(weight_scale) if cublas_scale is None
                   else cublas_scale)
        return fp8_scaled_mm.block_linear(x2, weight, scale_b).view(*x.shape[:-1], N)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out.view(*x.shape[:-1], N)
    # fp32 activations (tests, the fp32 conformance runs on CUDA) take the exact path even with
    # act_quant: x rounded to FP8 values, then an fp32 GEMM. The FP8 tensor cores' accumulation
    # within a 128-deep block is not fp32-exact, and release numerics amplify any difference.
    fp8_dot = act_quant and x.dtype != torch.float32
    cfg = config or gemm_config(M, N, K, fp8_dot, sm_count(x.device))
    if 128 % cfg["BLOCK_N"] or 128 % cfg["BLOCK_K"]:
        raise ValueError(f"fp8_block_linear: BLOCK_N and BLOCK_K must divide 128, got {cfg}")
    split = cfg["split"]
    c = out if split == 1 else torch.empty(split, M, N, dtype=torch.float32, device=x.device)
    grid = (cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"]), split)
    ws = weight_scale.float().contiguous()
    common = dict(BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], GROUP_M=8,
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    stride_cs = c.stride(0) if split > 1 else 0
    stride_cm = c.stride(-2)
    if fp8_dot:
        fuse = cfg.get("fuse_quant", False)
        q, s = (x2, x2) if fuse else quantize_act(x2)  # fused: s is never read
        _fp8_gemm_kernel[grid](
            q, s, weight, ws, c, M, N, K, cfg["steps_per_split"], q.stride(0),
            0 if fuse else s.stride(0), 0 if fuse else s.stride(1), weight.stride(0),
            ws.stride(0), stride_cs, stride_cm,
            QUANT_A=fuse, **common)
    else:
        if act_quant:
            x2 = round_act(x2)
        _wo_gemm_kernel[grid](
            x2, weight, ws, c, M, N, K, cfg["steps_per_split"] * cfg["BLOCK_K"], x2.stride(0),
            weight.stride(0), ws.stride(0), stride_cs, stride_cm, 0, 0, 0, 0,
            BLOCK_K=cfg["BLOCK_K"], DOT_PREC=dot_precision(x.dtype), **common)
    if split > 1:
        block = 1024
        _split_sum_kernel[(cdiv(M * N, block),)](c, out, M * N, SPLIT=split, BLOCK=block,
                                                        num_warps=4)
    return out.view(*x.shape[:-1], N)


def fp8_block_linear_pair(x, a, b):
    """(a(x), b(x)) for two FP8 block linears of one shape and numerics (modules with weight,
    weight_scale, act_quant): one GEMV launch for both where a single row would take the GEMV
    anyway (the shared expert's gate and up at decode), else each module's own call."""
    K = x.shape[-1]
    rows = x.numel() // K if K else 0
    if (x.is_cuda and rows <= fp8_gemv.DISPATCH_ROWS and fp8_gemv.fits(rows, K, x.dtype) and a.act_quant == b.act_quant
            and a.weight.shape == b.weight.shape and a.weight.shape[1] == K):
        x2 = x.reshape(rows, K)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        both = fp8_gemv.fp8_gemv_pair(x2, a.weight, a.weight_scale, b.weight, b.weight_scale, a.act_quant)
        N = a.weight.shape[0]
        return both[0].view(*x.shape[:-1], N), both[1].view(*x.shape[:-1], N)
    return a(x), b(x)


def takes_small_m(x, linear) -> bool:
    """Whether x [rows, K] (CUDA, unit last stride) into the FP8 block linear module `linear`
    takes the one-row GEMV or the Triton small-M GEMM on the auto path (1..SMALL_M_ROWS rows):
    where linears stacked on one input (Fp8RowStack) are one launch and faster than apart."""
    w = getattr(linear, "weight", None)
    return (x.is_cuda and x.dim() == 2 and x.stride(-1) == 1 and w is not None and w.dtype == torch.float8_e4m3fn
            and hasattr(linear, "weight_scale") and w.shape[1] == x.shape[1] and 1 <= x.shape[0] <= SMALL_M_ROWS)


def takes_one_row_gemv(x, linear) -> bool:
    """Whether x feeds the FP8 block linear module `linear` (weight e4m3 [N, K], weight_scale,
    act_quant) through fp8_gemv, as fp8_block_linear's auto path would send it: a single
    [rows, K] row block on CUDA with a unit last stride. The fused entry points below add their
    steps to that launch only then."""
    w = getattr(linear, "weight", None)
    return (x.is_cuda and x.dim() == 2 and x.stride(-1) == 1 and w is not None and w.dtype == torch.float8_e4m3fn
            and hasattr(linear, "weight_scale") and hasattr(linear, "act_quant") and w.shape[1] == x.shape[1]
            and x.shape[0] <= fp8_gemv.DISPATCH_ROWS and fp8_gemv.fits(x.shape[0], x.shape[1], x.dtype))


def _streams_fit(streams, x, linear) -> bool:
    return streams is None or fp8_gemv.streams_fit(streams, x.shape[0], linear.weight.shape[0], x.dtype)


def fp8_swiglu_linear_add(gate, up, linear, limit: float, add, streams=None):
    """(add + linear(swiglu_clamped(gate, up, limit) in gate.dtype)) summed in fp32, rounded to
    gate.dtype, for an FP8 block linear module (weight, weight_scale, act_quant): one GEMV launch
    for the activation, the linear and the sum where a single row would take the GEMV anyway
    (the shared expert's down projection at decode), else the three steps. streams (residual,
    post, comb): the mHC streams after that output instead (mhc.hc_post), in the same launch.
    add may be the routed experts' rows before their sum (moe.RoutedRows): the GEMV sums them,
    every other path sums them first."""
    M, N = gate.shape[0], linear.weight.shape[0]
    routed = isinstance(add, RoutedRows)
    rows = add.partial if routed else add
    if (takes_one_row_gemv(gate, linear) and up.shape == gate.shape and up.stride() == gate.stride()
            and (not routed or add.ids.shape[0] == M)
            and rows.shape == (add.ids.numel() if routed else M, N) and rows.stride(-1) == 1
            and _streams_fit(streams, gate, linear)):
        return fp8_gemv.fp8_gemv_swiglu_add(gate, up, linear.weight, linear.weight_scale, linear.act_quant,
                                            limit, add, streams=streams)
    if routed:
        add = add.sum()
    y = add_fp32(add, linear(swiglu_clamped(gate, up, limit, gate.dtype)), gate.dtype)
    return y if streams is None else hc_post(y, *streams)


def fp8_rms_linear(x, norm_weight, eps: float, linear):
    """linear(rms_norm(x, norm_weight, eps)) for an FP8 block linear module: one GEMV launch,
    the norm in its prologue, where takes_one_row_gemv; else the norm kernel, then the linear."""
    if takes_one_row_gemv(x, linear):
        return fp8_gemv.fp8_gemv(x, linear.weight, linear.weight_scale, linear.act_quant, rms=(norm_weight, eps))
    return linear(rms_norm(x, norm_weight, eps))


def fp8_linear_hc_post(x, linear, residual, post, comb):
    """mhc.hc_post(linear(x), residual, post, comb) for an FP8 block linear module: one GEMV
    launch where a single row would take the GEMV anyway (a decode sub-layer's last linear),
    else the linear and the post step."""
    streams = (residual, post, comb)
    if takes_one_row_gemv(x, linear) and _streams_fit(streams, x, linear):
        return fp8_gemv.fp8_gemv(x, linear.weight, linear.weight_scale, linear.act_quant, streams=streams)
    return hc_post(linear(x), residual, post, comb)


def fp8_grouped_linear(x, weight, weight_scale, config: dict | None = None):
    """Block-diagonal weight-only FP8 linear: x [T, G, K] -> x.dtype [T, G, n], group g through
    weight rows [g n, (g + 1) n) (n = N / G, a whole number of 128-row scale blocks). The same
    products and fp32 sums as G weight-only fp8_block_linear calls, in one launch of the
    weight-only kernel (a grid axis per group) and at most one split-K sum: wo_a at decode sizes
    was 17 launches per layer (8 GEMMs, 8 sums and a stack), each far shorter than its launch.
    The split follows the G groups' tiles together (gemm_config over N = G n)."""
    T, G, K = x.shape
    N = weight.shape[0]
    n = N // G
    if weight.dtype != torch.float8_e4m3fn or weight.stride(-1) != 1 or weight.shape[1] != K:
        raise ValueError(f"fp8_grouped_linear: weight {weight.dtype} {tuple(weight.shape)} does not "
                         f"fit x {tuple(x.shape)} (row-major float8_e4m3fn [G * n, K])")
    if n * G != N or n % 128:
        raise ValueError(f"fp8_grouped_linear: {N} weight rows over {G} groups must be whole "
                         "128-row blocks per group")
    if tuple(weight_scale.shape) != (N // 128, cdiv(K, 128)):
        raise ValueError(f"fp8_grouped_linear: weight_scale {tuple(weight_scale.shape)} for "
                         f"weight {(N, K)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if config is None and x.is_cuda and T <= fp8_gemv.DISPATCH_ROWS and fp8_gemv.fits(T, K, x.dtype):
        return fp8_gemv.fp8_grouped_gemv(x, weight, weight_scale)
    out = torch.empty(T, G, n, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    cfg = config or gemm_config(T, N, K, False, sm_count(x.device))
    if 128 % cfg["BLOCK_N"] or 128 % cfg["BLOCK_K"]:
        raise ValueError(f"fp8_grouped_linear: BLOCK_N and BLOCK_K must divide 128, got {cfg}")
    split = cfg["split"]
    c = out if split == 1 else torch.empty(split, T, G, n, dtype=torch.float32, device=x.device)
    ws = weight_scale.float().contiguous()
    grid = (cdiv(T, cfg["BLOCK_M"]) * cdiv(n, cfg["BLOCK_N"]), split, G)
    _wo_gemm_kernel[grid](
        x, weight, ws, c, T, n, K, cfg["steps_per_split"] * cfg["BLOCK_K"], x.stride(0),
        weight.stride(0), ws.stride(0), c.stride(0) if split > 1 else 0, c.stride(-3),
        x.stride(1), n * weight.stride(0), (n // 128) * ws.stride(0), c.stride(-2),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=8,
        DOT_PREC=dot_precision(x.dtype), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if split > 1:
        block = 1024
        _split_sum_kernel[(cdiv(T * N, block),)](c, out, T * N, SPLIT=split, BLOCK=block,
                                                 num_warps=4)
    return out
