"""FP8 block-scaled linear for a few rows (decode): weights streamed once at HBM speed.

At one row a GEMM's tensor-core tiles are mostly padding and its fixed cost dominates: inside
Flash's decode graph on an H200 cuBLAS's block-scaled GEMM took ~14 µs at M = 1 whatever the
weight (4 MB wq_a or 32 MB wq_b), where reading the bytes takes 1-7 µs. Up to 4 rows run
here; fp8_gemm sends it one row only (from two rows on its tensor-core GEMM measured faster). This kernel is a GEMV on the CUDA cores:
each program owns BLOCK_N weight rows, walks K in BLOCK_K slabs (whole 128-blocks), and
keeps one fp32 accumulator per (row of x, weight row). No split-K: the output rows are
divided among programs, so the sum order is fixed (deterministic) and there is one launch.

Numerics are those of quant_reference.fp8_block_linear_ref:
- release numerics (act_quant): each 128-block of a row of x is rounded to e4m3 with a
  power-of-two scale inside the kernel (fp8_act_quant's helpers, bit for bit), so no separate
  quantization launch; a block's 128 products (exact in fp32: 4-bit x 4-bit significands)
  are summed in fp32, then scaled by (x scale x weight scale), a power of two;
- weight-only: the e4m3 weights times their block scale (exact) against x in fp32.
The fp32 sums differ from the tensor cores' only in order (and are not truncated as the FP8
MMA's accumulation is).

Optional steps ride along. Before the products, RMS: x's rows RMS-normalised with a weight
first (elementwise.rms_norm's formula, rounded to x's dtype), so an RMSNorm between two linears
costs no launch of its own (q_norm before wq_b and the indexer's wq_b). And so that a decode
sub-layer ends in its last linear's launch (the shared expert's tail: one launch instead of
four):
- SWIGLU takes x as a gate / up pair and feeds the kernel silu(min(gate, limit)) *
  clamp(up, +-limit) rounded to the output dtype (elementwise.swiglu_clamped's formula);
- ADD returns (add + the output rounded to its dtype) in fp32, rounded once more (add_fp32:
  the routed experts' fp32 sum plus the shared expert's output), or sums that fp32 sum itself
  from the routed experts' rows first (moe.RoutedRows: the top-k sum's launch gone);
- HC writes, instead of the output f, the mHC streams after it (mhc.hc_post's formula and
  order on f as stored).

Groups share a launch (grid axis 1): group g reads its x columns, its weight and scale rows
and writes its outputs, each at g times a stride. wo_a's block-diagonal einsum: x [:, g, :]
through weight rows [g n, (g + 1) n); a pair of linears of one shape on the same x (the
shared expert's gate and up): the second weight's offset from the first as the stride.

Graph-safe: no host syncs; the grid depends only on shapes.
"""

import torch
import triton
import triton.language as tl

from . import pdl
from .fp8_act_quant import INV_E4M3_MAX, QBLOCK, e4m3_bits, pow2_recip, pow2_scale
from .host_math import cdiv, next_power_of_2

MAX_ROWS = 4  # every weight element costs M FMAs here
DISPATCH_ROWS = 1  # fp8_gemm's auto path takes it for this many rows: from 2 on the tensor-core GEMM won


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, w_ptr, ws_ptr, out_ptr, M, N, K,
    stride_xm, stride_xg, stride_w, stride_wg, stride_ws, stride_wsg, stride_om, stride_og,
    up_offset, limit, add_ptr, stride_am, ids_ptr, topk, num_experts,
    res_ptr, stride_rm, stride_rh, post_ptr, stride_pm, comb_ptr, stride_cm, stride_ci, stride_oh,
    rms_w_ptr, rms_eps,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ACT_QUANT: tl.constexpr,
    SWIGLU: tl.constexpr, HAS_LIMIT: tl.constexpr, ADD: tl.constexpr, HC: tl.constexpr, RMS: tl.constexpr,
    TOPK_SUM: tl.constexpr = False, PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    pid_n = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)
    NB: tl.constexpr = BLOCK_K // 128
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    # group g: its x columns, weight rows, scale rows and outputs, each g strides on
    rows_w = offs_n.to(tl.int64)
    w_ptr += g * stride_wg
    ws_ptr += g * stride_wsg
    x_base = x_ptr + g * stride_xg
    offs_k = tl.arange(0, BLOCK_K)
    row_ids = tl.arange(0, ROWS)
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    if RMS:  # each row's 1 / RMS over all of K, before any product
        inv_rms = tl.zeros([ROWS], tl.float32)
        for r in tl.static_range(ROWS):
            sq = tl.zeros([BLOCK_K], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                xs = tl.load(x_base + r * stride_xm + k0 + offs_k, mask=(k0 + offs_k < K) & (offs_k * 0 + r < M),
                             other=0.0).to(tl.float32)
                sq += xs * xs
            inv_rms = tl.where(row_ids == r, tl.rsqrt(tl.sum(sq, 0) / K + rms_eps), inv_rms)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < K
        w = tl.load(w_ptr + rows_w[:, None] * stride_w + k[None, :],
                    mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        kb = k0 // 128 + tl.arange(0, NB)
        sw = tl.load(ws_ptr + (rows_w // 128)[:, None] * stride_ws + kb[None, :],
                     mask=n_mask[:, None] & (kb * 128 < K)[None, :], other=0.0)
        for r in tl.static_range(ROWS):
            xr = tl.load(x_base + r * stride_xm + k, mask=k_mask & (offs_k * 0 + r < M), other=0.0).to(tl.float32)
            if RMS:
                xr = xr * tl.sum(tl.where(row_ids == r, inv_rms, 0.0), 0)
                xr = tl.load(rms_w_ptr + k, mask=k_mask, other=0.0).to(tl.float32) * xr
                xr = xr.to(x_ptr.dtype.element_ty).to(tl.float32)
            if SWIGLU:  # xr is the gate; the up row sits up_offset elements on
                ur = tl.load(x_base + up_offset + r * stride_xm + k, mask=k_mask & (offs_k * 0 + r < M),
                             other=0.0).to(tl.float32)
                if HAS_LIMIT:
                    xr = tl.minimum(xr, limit)
                    ur = tl.minimum(tl.maximum(ur, -limit), limit)
                xr = (xr / (1.0 + tl.exp(-xr)) * ur).to(out_ptr.dtype.element_ty).to(tl.float32)
            xb = tl.reshape(xr, [NB, 128])
            if ACT_QUANT:
                sx = pow2_scale(tl.max(tl.abs(xb), axis=1), INV_E4M3_MAX)
                v = tl.minimum(tl.maximum(xb * pow2_recip(sx)[:, None], -448.0), 448.0)
                xb = e4m3_bits(v).to(tl.float8e4nv, bitcast=True).to(tl.float32)
            p = tl.reshape(w, [BLOCK_N, NB, 128]) * xb[None, :, :]
            part = tl.sum(p, axis=2)  # [BLOCK_N, NB]: one 128-block's sum each
            if ACT_QUANT:
                part = part * (sw * sx[None, :])
            else:
                part = part * sw
            acc += tl.where(row_ids[:, None] == r, tl.sum(part, axis=1)[None, :], 0.0)
    out = out_ptr + g * stride_og + row_ids[:, None] * stride_om + offs_n[None, :]
    out_mask = (row_ids < M)[:, None] & n_mask[None, :]
    if ADD:
        if TOPK_SUM:  # add = each row's routed rows summed here, as moe.sum_topk sums them
            a = tl.zeros([ROWS, BLOCK_N], tl.float32)
            for k in range(topk):
                assign = row_ids * topk + k
                e = tl.load(ids_ptr + assign, mask=row_ids < M, other=-1)
                n = N * ((e >= 0) & (e < num_experts)).to(tl.int32)  # 0: a skipped assignment
                a += tl.load(add_ptr + assign.to(tl.int64)[:, None] * stride_am + offs_n[None, :],
                             mask=out_mask & (offs_n[None, :] < n[:, None]), other=0.0).to(tl.float32)
        else:
            a = tl.load(add_ptr + row_ids[:, None] * stride_am + offs_n[None, :], mask=out_mask, other=0.0)
        acc = a.to(tl.float32) + acc.to(out_ptr.dtype.element_ty).to(tl.float32)
    if HC:
        # out holds the streams: X'_j = post_j * f + sum_i comb[i, j] * X_i, f as stored
        f = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        m_mask = row_ids < M
        for j in tl.static_range(HC):
            mixed = tl.zeros([ROWS, BLOCK_N], tl.float32)
            for i in tl.static_range(HC):
                c = tl.load(comb_ptr + row_ids * stride_cm + i * stride_ci + j, mask=m_mask, other=0.0)
                r = tl.load(res_ptr + row_ids[:, None] * stride_rm + i * stride_rh + offs_n[None, :],
                            mask=out_mask, other=0.0).to(tl.float32)
                mixed += c[:, None] * r
            pj = tl.load(post_ptr + row_ids * stride_pm + j, mask=m_mask, other=0.0)
            tl.store(out + j * stride_oh, (pj[:, None] * f + mixed).to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def gemv_config(M: int, N: int, K: int, groups: int = 1) -> dict:
    """Tiles by shape, from a sweep of BLOCK_N x BLOCK_K x warps x stages at Flash's eight
    one-row linears on an H200 (sgl-kernel/benchmark/bench_small_m_linears.py --sweep 1): the
    best tiles hold ~16K weights, as deep along K as possible (all of K up to 4096, so a
    program issues its whole share at once), then as many rows as fit; 4 warps, 2 stages.
    Past K = 4096 (wo_b) 2048-deep slabs of 8 rows beat 4096-deep ones of 4 (19.0 vs 20.1 µs).
    Each shape's choice was within 3.2% of the best of 68 tiles (docs/benchmarks.md §5; 8
    warps were up to 9% off). M and the groups do not change the choice (measured at one row)."""
    block_k = max(128, next_power_of_2(K)) if K <= 4096 else 2048
    block_n = max(1, min(16, 16384 // block_k))
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=2)


def fits(M: int, K: int, x_dtype: torch.dtype) -> bool:
    """Whether this kernel takes the call: few rows, whole 128-blocks along K, float x."""
    return 0 < M <= MAX_ROWS and K % QBLOCK == 0 and x_dtype in (torch.bfloat16, torch.float16,
                                                                  torch.float32)


def fp8_gemv(x2: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, act_quant: bool,
             config: dict | None = None, streams: tuple | None = None, rms: tuple | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS, unit last stride) -> x.dtype [M, N] = fp8_block_linear_ref.
    streams (residual [M, hc, N], post [M, hc], comb [M, hc, hc]): returns hc_post(that output,
    residual, post, comb) [M, hc, N] instead, in the residual's dtype (check_streams).
    rms (weight [K], eps): x's rows go through that RMSNorm first (elementwise.rms_norm)."""
    M, K = x2.shape
    N = weight.shape[0]
    if not fits(M, K, x2.dtype) or x2.stride(-1) != 1:
        raise ValueError(f"fp8_gemv: x {tuple(x2.shape)} {x2.dtype} strides {x2.stride()} does not fit "
                         f"(1..{MAX_ROWS} rows, K % 128 == 0, unit last stride)")
    if rms is not None and (rms[0].shape != (K,) or rms[0].stride(-1) != 1):
        raise ValueError(f"fp8_gemv: the norm weight {tuple(rms[0].shape)} must be [{K}] with a unit stride")
    out = _output(M, N, x2, streams)
    ws = _scales(weight_scale)
    _launch(x2, weight, ws, out, M, N, K, 1, x2.stride(0), 0, 0, 0, out.stride(0), 0, act_quant, config,
            streams=streams, rms=rms)
    return out


def streams_fit(streams: tuple, M: int, N: int, dtype: torch.dtype) -> bool:
    """Whether the HC epilogue can read these streams: residual [M, hc, N] of the output dtype
    with unit last stride, fp32 post [M, hc] and comb [M, hc, hc] contiguous per row; hc a
    power of two."""
    res, post, comb = streams
    hc = res.shape[1] if res.dim() == 3 else 0
    return (res.shape == (M, hc, N) and res.dtype == dtype and res.stride(-1) == 1 and hc >= 1 and not hc & (hc - 1)
            and post.shape == (M, hc) and comb.shape == (M, hc, hc) and post.dtype == torch.float32
            and comb.dtype == torch.float32 and post.stride(-1) == 1 and comb.stride(-1) == 1
            and comb.stride(1) == hc)


def check_streams(streams: tuple, M: int, N: int, dtype: torch.dtype) -> None:
    if not streams_fit(streams, M, N, dtype):
        res, post, comb = streams
        raise ValueError(f"fp8_gemv streams: residual {tuple(res.shape)} {res.dtype}, post {tuple(post.shape)}, comb "
                         f"{tuple(comb.shape)} do not fit [{M}, hc, {N}] {dtype} / fp32 [{M}, hc] / fp32 "
                         f"[{M}, hc, hc] (hc a power of two, unit last strides)")


def _output(M: int, N: int, x: torch.Tensor, streams: tuple | None) -> torch.Tensor:
    if streams is None:
        return torch.empty(M, N, dtype=x.dtype, device=x.device)
    check_streams(streams, M, N, x.dtype)
    return torch.empty(M, streams[0].shape[1], N, dtype=x.dtype, device=x.device)


def fp8_gemv_pair(x2: torch.Tensor, weight_a: torch.Tensor, scale_a: torch.Tensor, weight_b: torch.Tensor,
                  scale_b: torch.Tensor, act_quant: bool, config: dict | None = None) -> torch.Tensor:
    """Two linears of one shape on the same x [M, K] in one launch: [2, M, N] (a's, then b's).
    The weights may live anywhere: group 1 is reached from group 0 by their address difference."""
    M, K = x2.shape
    N = weight_a.shape[0]
    if weight_b.shape != weight_a.shape or weight_b.stride() != weight_a.stride() or weight_b.dtype != weight_a.dtype:
        raise ValueError(f"fp8_gemv_pair: weights {tuple(weight_a.shape)} / {tuple(weight_b.shape)} differ in shape, "
                         "strides or dtype")
    if not fits(M, K, x2.dtype) or x2.stride(-1) != 1:
        raise ValueError(f"fp8_gemv_pair: x {tuple(x2.shape)} does not fit (1..{MAX_ROWS} rows, K % 128 == 0)")
    sa, sb = _scales(scale_a), _scales(scale_b)
    if sb.shape != sa.shape or sb.stride() != sa.stride():
        raise ValueError("fp8_gemv_pair: the two weights' scales differ in shape or strides")
    out = torch.empty(2, M, N, dtype=x2.dtype, device=x2.device)
    elem = weight_a.element_size()
    _launch(x2, weight_a, sa, out, M, N, K, 2, x2.stride(0), 0, (weight_b.data_ptr() - weight_a.data_ptr()) // elem,
            (sb.data_ptr() - sa.data_ptr()) // 4, out.stride(1), out.stride(0), act_quant, config)
    return out


def fp8_gemv_swiglu_add(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                        act_quant: bool, limit: float, add, config: dict | None = None,
                        streams: tuple | None = None) -> torch.Tensor:
    """gate.dtype [M, N] = (add + fp8_block_linear_ref(swiglu_clamped(gate, up, limit) in
    gate.dtype)) summed in fp32: the shared expert's down projection with its activation before
    and the routed experts' fp32 sum `add` [M, N] after, in one launch. `add` may also be the
    routed experts' rows before their sum (moe.RoutedRows): the kernel then sums each row's
    top-k rows itself, in moe.sum_topk's order, so one launch fewer and the same bits.
    gate and up [M, K] with one row stride (up may sit anywhere relative to gate: fp8_gemv_pair's
    two halves). streams: as fp8_gemv's (the MoE's output goes straight into the mHC streams)."""
    M, K = gate.shape
    N = weight.shape[0]
    routed = None
    if not isinstance(add, torch.Tensor):
        routed, add = add, add.partial
        if routed.ids.shape[0] != M or add.shape[0] != routed.ids.numel():
            raise ValueError(f"fp8_gemv_swiglu_add: routed rows {tuple(add.shape)} with ids {tuple(routed.ids.shape)} "
                             f"are not {M} rows' top-k")
    if up.shape != gate.shape or up.dtype != gate.dtype or up.stride() != gate.stride():
        raise ValueError(f"fp8_gemv_swiglu_add: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape, "
                         "dtype or strides")
    if not fits(M, K, gate.dtype) or gate.stride(-1) != 1:
        raise ValueError(f"fp8_gemv_swiglu_add: gate {tuple(gate.shape)} does not fit (1..{MAX_ROWS} rows, "
                         "K % 128 == 0, unit last stride)")
    if add.shape[1:] != (N,) or (routed is None and add.shape[0] != M) or add.stride(-1) != 1:
        raise ValueError(f"fp8_gemv_swiglu_add: add {tuple(add.shape)} must be [{M}, {N}] with a unit last stride")
    out = _output(M, N, gate, streams)
    _launch(gate, weight, _scales(weight_scale), out, M, N, K, 1, gate.stride(0), 0, 0, 0, out.stride(0), 0,
            act_quant, config, up_offset=(up.data_ptr() - gate.data_ptr()) // gate.element_size(), limit=limit,
            add=add, streams=streams, routed=routed)
    return out


def fp8_grouped_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     config: dict | None = None) -> torch.Tensor:
    """Weight-only block-diagonal: x [T, G, K] (T <= MAX_ROWS) -> x.dtype [T, G, n], group g
    through weight rows [g n, (g + 1) n) (n % 128 == 0: whole scale blocks per group)."""
    T, G, K = x.shape
    n = weight.shape[0] // G
    if not fits(T, K, x.dtype) or x.stride(-1) != 1 or n % 128:
        raise ValueError(f"fp8_grouped_gemv: x {tuple(x.shape)} does not fit (1..{MAX_ROWS} rows, "
                         "K % 128 == 0, unit last stride, whole 128-row blocks per group)")
    out = torch.empty(T, G, n, dtype=x.dtype, device=x.device)
    ws = _scales(weight_scale)
    _launch(x, weight, ws, out, T, n, K, G, x.stride(0), x.stride(1), n * weight.stride(0), (n // 128) * ws.stride(0),
            out.stride(0), out.stride(1), False, config)
    return out


def _scales(weight_scale: torch.Tensor) -> torch.Tensor:
    """The fp32 block scales with a unit last stride (a copy only when they are not)."""
    if weight_scale.dtype == torch.float32 and weight_scale.stride(-1) == 1:
        return weight_scale
    return weight_scale.float().contiguous()


def _launch(x, weight, ws, out, M, N, K, G, sxm, sxg, swg, swsg, som, sog, act_quant, config,
            up_offset=None, limit=0.0, add=None, streams=None, rms=None, routed=None):
    """streams: (residual [M, hc, N], post [M, hc], comb [M, hc, hc]); out is then [M, hc, N].
    rms: (weight [K], eps) of the norm applied to x's rows first. routed (moe.RoutedRows):
    add holds its rows [M * topk, N], summed per row in the kernel."""
    cfg = config or gemv_config(M, N, K, G)
    if cfg["BLOCK_K"] % 128:
        raise ValueError(f"fp8_gemv: BLOCK_K must be whole 128-blocks, got {cfg}")
    res, post, comb = streams if streams is not None else (out, out, out)  # (never read without)
    hc = res.shape[1] if streams is not None else 0
    ids = routed.ids.reshape(-1).contiguous() if routed is not None else ws  # (never read without)
    _fp8_gemv_kernel[(cdiv(N, cfg["BLOCK_N"]), G)](
        x, weight, ws, out, M, N, K, sxm, sxg, weight.stride(0), swg, ws.stride(0), swsg, som, sog,
        up_offset or 0, float(limit), out if add is None else add, 0 if add is None else add.stride(0),
        ids, routed.ids.shape[1] if routed is not None else 0, routed.num_experts if routed is not None else 0,
        res, res.stride(0), res.stride(1) if hc else 0, post, post.stride(0), comb, comb.stride(0),
        comb.stride(1) if hc else 0, out.stride(1) if hc else 0,
        rms[0] if rms is not None else ws, float(rms[1]) if rms is not None else 0.0,
        ROWS=next_power_of_2(M), BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], ACT_QUANT=act_quant,
        SWIGLU=up_offset is not None, HAS_LIMIT=limit > 0, ADD=add is not None, HC=hc, RMS=rms is not None,
        TOPK_SUM=routed is not None, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl.options(x))
