"""Triton kernels for the manifold-constrained hyper-connections (mHC).

hc_pre: per token, the (2 + hc) * hc mixes of the RMS-normalised flattened residual copies,
the sigmoid gates, the Sinkhorn projection of the hc x hc comb matrix, and the gated sum of the
copies (~90 launches in torch, mostly the Sinkhorn loop). Two launches, because the mixes are a
skinny GEMM (MIX = 24 columns, K = hc * d = 16384 at Flash) that needs the whole GPU at every T,
while the rest is per token:
  1. _hc_mixes_kernel, grid (cdiv(T, BLOCK_T), SPLIT): split-K tl.dot of x tiles by fn^T tiles,
     plus the sums of squares, as fp32 partials in a per-call [SPLIT, T, BLOCK_M] workspace.
     For bf16 x the fp32 products stay exact on tensor cores: fn is split into three
     bf16-valued pieces, and a bf16 x bf16 product is exact in fp32 (an fp32 FMA dot,
     input_precision="ieee", made this kernel ~10x slower at T = 4096; fp16 x is split too).
     fp32 x (fp32 models) takes that fp32 FMA dot: exact products, fp32 sums.
  2. _hc_finish_kernel, grid (T, cdiv(d, BLOCK_D)): sums the partials in a fixed order
     (deterministic, no atomics), then the gates and the y columns of its block; the token's
     first program also does the Sinkhorn and stores post / comb. Splitting y over d keeps a
     decode step on more than one SM.
Split rule (_plan): the smallest SPLIT that gives ~2 programs per SM over the token blocks, at
most one K tile (BLOCK_K columns of one copy) per program, so SPLIT = 1 once the token blocks
alone fill the GPU. At T = 1 and d = 4096 that is 256 programs of one tile. K tiles never
straddle two copies: x's per-copy stride (even a stride-0 expand) and a ragged d cost a mask.
hc_post: X'_j = post_j * f + sum_i comb[i, j] * X_i.

Math is fp32 throughout (as in reference.py); only y / out are cast to the activation dtype.
Shapes are static, the workspace comes from torch.empty and nothing syncs, so both are graph
capturable.
"""

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import pdl
from .host_math import cdiv, next_power_of_2, sm_count

# Programs per SM the split aims for (latency hiding for a streaming kernel).
_PROGRAMS_PER_SM = 2


@triton.jit
def _split3(v):
    """fp32 -> three fp32 holding bf16 values (8 + 8 + 8 mantissa bits) whose sum is v exactly:
    each difference below is exact in fp32."""
    hi = v.to(tl.bfloat16).to(tl.float32)
    r = v - hi
    mid = r.to(tl.bfloat16).to(tl.float32)
    return hi, mid, r - mid


@triton.jit
def _dot(a, b, acc, DOT_BF16: tl.constexpr):
    """acc + a @ b for a, b holding bf16 values: bf16 tensor cores, or tf32 (which holds a bf16
    exactly) under the interpreter, whose numpy dot cannot take bf16. Exact products either way."""
    if DOT_BF16:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
    else:
        return tl.dot(a.to(tl.float32), b, acc, input_precision="tf32")


@triton.jit
def _hc_mixes_kernel(
    x_ptr, stride_xt, stride_xh, fn_ptr, stride_fn, ws_ptr, stride_ws, sq_ptr, stride_sq,
    T, D, k_blocks, tiles_per_split,
    MIX: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    HC: tl.constexpr, X_BF16: tl.constexpr, X_FP32: tl.constexpr, DOT_BF16: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    toks = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    split = tl.program_id(1)
    tok_mask = toks < T
    m = tl.arange(0, BLOCK_M)
    k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + toks[:, None] * stride_xt
    fn_cols = fn_ptr + m[None, :] * stride_fn  # fn^T: K down, mixes across
    m_mask = m[None, :] < MIX

    # This program's K tiles: tile t is columns [c0, c0 + BLOCK_K) of copy h = t // k_blocks,
    # i.e. fn columns h * D + c0 + k. The last split may hold fewer tiles.
    t_lo = split * tiles_per_split
    t_hi = tl.minimum(t_lo + tiles_per_split, HC * k_blocks)
    acc = tl.zeros([BLOCK_T, BLOCK_M], dtype=tl.float32)
    sq = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    for t in range(t_lo, t_hi):
        h = t // k_blocks
        cols = (t - h * k_blocks) * BLOCK_K + k
        c_mask = cols < D
        xr = tl.load(x_rows + h * stride_xh + cols[None, :],
                     mask=tok_mask[:, None] & c_mask[None, :], other=0.0)
        xv = xr.to(tl.float32)
        sq += xv * xv
        w = tl.load(fn_cols + (h * D + cols)[:, None], mask=c_mask[:, None] & m_mask, other=0.0)
        # fp32 x (fp32 models: conformance, tests): the fp32 FMA dot, the reference's products
        # and fp32 sums up to order (a split of x too would drop the terms below 2^-24 and sum
        # on tensor cores).
        # 16-bit x: exact fp32 products on tensor cores: fn as three bf16-valued pieces, x as it
        # is (bf16) or in three pieces too; a product of two bf16 values is exact in the fp32
        # accumulator. The fp32 FMA dot (input_precision="ieee") ran ~10x slower.
        # Each tile's dots start from zero and are added to acc in registers: the tensor
        # cores' accumulation truncates, and chaining a whole K slice through it lost ~1e-4
        # relative at prefill.
        if X_FP32:
            part = tl.dot(xv, w.to(tl.float32), input_precision="ieee")
        elif X_BF16:
            w_hi, w_mid, w_lo = _split3(w.to(tl.float32))
            part = _dot(xr, w_lo, tl.zeros([BLOCK_T, BLOCK_M], dtype=tl.float32), DOT_BF16)
            part = _dot(xr, w_mid, part, DOT_BF16)
            part = _dot(xr, w_hi, part, DOT_BF16)
        else:
            # Terms below 2^-24 of the leading one are dropped: fp32 rounding's size.
            w_hi, w_mid, w_lo = _split3(w.to(tl.float32))
            x_hi, x_mid, x_lo = _split3(xv)
            part = _dot(x_mid, w_mid, tl.zeros([BLOCK_T, BLOCK_M], dtype=tl.float32), DOT_BF16)
            part = _dot(x_lo, w_hi, part, DOT_BF16)
            part = _dot(x_hi, w_lo, part, DOT_BF16)
            part = _dot(x_mid, w_hi, part, DOT_BF16)
            part = _dot(x_hi, w_mid, part, DOT_BF16)
            part = _dot(x_hi, w_hi, part, DOT_BF16)
        acc += part
    tl.store(ws_ptr + split * stride_ws + toks[:, None] * BLOCK_M + m[None, :], acc,
             mask=tok_mask[:, None])
    tl.store(sq_ptr + split * stride_sq + toks, tl.sum(sq, axis=1), mask=tok_mask)


@triton.jit
def _hc_finish_kernel(
    x_ptr, stride_xt, stride_xh, ws_ptr, stride_ws, sq_ptr, stride_sq, scale_ptr, base_ptr,
    y_ptr, stride_yt, post_ptr, stride_pt, comb_ptr, stride_ct, rms_w_ptr, yn_ptr, stride_ynt,
    D, split, iters, hc_eps, norm_eps, rms_eps,
    HC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    RMS: tl.constexpr, BLOCK_ROW: tl.constexpr, SINKHORN_PID: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Without RMS: program (t, 0) does the Sinkhorn, every program (t, c) y's BLOCK_D columns
    c. With RMS (grid (T, 2)): program (t, 1) does the Sinkhorn while (t, 0) writes the whole y
    row, then the sub-layer's RMSNorm of it into yn (elementwise._rms_norm_kernel's math on
    the stored y read back as one row: the same formula, one launch fewer; its sums may run in
    another order than the norm kernel's)."""
    pdl.enter(PDL)
    tok = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, HC)
    s = tl.arange(0, BLOCK_S)
    row = ws_ptr + tok * BLOCK_M  # workspace row: [pre | post | comb] partial mixes

    # Every program of the token sums the pre partials and the sums of squares (a few hundred
    # bytes) in a fixed order; program 0 of the token also does post and the Sinkhorn.
    p_pre = tl.zeros([BLOCK_S, HC], dtype=tl.float32)
    p_sq = tl.zeros([BLOCK_S], dtype=tl.float32)
    for s0 in range(0, split, BLOCK_S):
        ss = s0 + s
        s_mask = ss < split
        p_pre += tl.load((row + ss * stride_ws)[:, None] + i[None, :], mask=s_mask[:, None], other=0.0)
        p_sq += tl.load(sq_ptr + ss * stride_sq + tok, mask=s_mask, other=0.0)
    inv_rms = tl.rsqrt(tl.sum(p_sq, axis=0) / (HC * D) + norm_eps)
    pre = tl.sigmoid(tl.sum(p_pre, axis=0) * inv_rms * tl.load(scale_ptr) + tl.load(base_ptr + i)) + hc_eps

    if tl.program_id(1) == SINKHORN_PID:
        j = tl.arange(0, HC)
        ij = i[:, None] * HC + j[None, :]
        p_post = tl.zeros([BLOCK_S, HC], dtype=tl.float32)
        p_comb = tl.zeros([BLOCK_S, HC, HC], dtype=tl.float32)
        for s0 in range(0, split, BLOCK_S):
            ss = s0 + s
            s_mask = ss < split
            r = row + ss * stride_ws
            p_post += tl.load(r[:, None] + HC + i[None, :], mask=s_mask[:, None], other=0.0)
            p_comb += tl.load(r[:, None, None] + 2 * HC + ij[None, :, :],
                              mask=s_mask[:, None, None], other=0.0)
        post = 2.0 * tl.sigmoid(tl.sum(p_post, axis=0) * inv_rms * tl.load(scale_ptr + 1)
                                + tl.load(base_ptr + HC + i))
        logits = tl.sum(p_comb, axis=0) * inv_rms * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * HC + ij)
        e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        comb = e / tl.sum(e, axis=1)[:, None] + hc_eps
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
        # Same order as the reference: (iters - 1) x [rows, columns], ending on columns.
        for _ in range(iters - 1):
            comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
            comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
        tl.store(post_ptr + tok * stride_pt + i, post)
        tl.store(comb_ptr + tok * stride_ct + ij, comb)

    if RMS:
        if tl.program_id(1) == 0:
            for c0 in tl.static_range(0, BLOCK_ROW, BLOCK_D):
                _gated_sum_block(x_ptr, stride_xt, stride_xh, y_ptr, stride_yt, tok, i, pre, c0, D, BLOCK_D)
            tl.debug_barrier()  # the row's y stores are visible to every thread of the program
            offs = tl.arange(0, BLOCK_ROW)
            r_mask = offs < D
            yr = tl.load(y_ptr + tok * stride_yt + offs, mask=r_mask, other=0.0).to(tl.float32)
            yr = yr * tl.rsqrt(tl.sum(yr * yr, 0) / D + rms_eps)
            yr = tl.load(rms_w_ptr + offs, mask=r_mask, other=0.0).to(tl.float32) * yr
            tl.store(yn_ptr + tok * stride_ynt + offs, yr.to(yn_ptr.dtype.element_ty), mask=r_mask)
    else:
        # This program's BLOCK_D columns of y, from a second read of the token's copies.
        _gated_sum_block(x_ptr, stride_xt, stride_xh, y_ptr, stride_yt, tok, i, pre,
                         tl.program_id(1) * BLOCK_D, D, BLOCK_D)


@triton.jit
def _gated_sum_block(x_ptr, stride_xt, stride_xh, y_ptr, stride_yt, tok, i, pre, c0, D, BLOCK_D: tl.constexpr):
    """y[tok, c0:c0 + BLOCK_D] = sum_i pre_i x[tok, i, c0:c0 + BLOCK_D], stored in y's dtype."""
    cols = c0 + tl.arange(0, BLOCK_D)
    c_mask = cols < D
    xv = tl.load(x_ptr + tok * stride_xt + i[:, None] * stride_xh + cols[None, :],
                 mask=c_mask[None, :], other=0.0).to(tl.float32)
    yv = tl.sum(pre[:, None] * xv, axis=0)
    tl.store(y_ptr + tok * stride_yt + cols, yv.to(y_ptr.dtype.element_ty), mask=c_mask)


@triton.jit
def _hc_post_kernel(
    f_ptr, stride_ft, res_ptr, stride_rt, stride_rh, post_ptr, stride_pt,
    comb_ptr, stride_ct, stride_ci, out_ptr, stride_ot, stride_oh, D,
    HC: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    c_mask = cols < D
    j = tl.arange(0, HC)
    f = tl.load(f_ptr + t * stride_ft + cols, mask=c_mask, other=0.0).to(tl.float32)
    post = tl.load(post_ptr + t * stride_pt + j).to(tl.float32)
    mixed = tl.zeros([HC, BLOCK_D], dtype=tl.float32)
    for i in tl.static_range(HC):
        c = tl.load(comb_ptr + t * stride_ct + i * stride_ci + j).to(tl.float32)  # comb[t, i, :]
        r = tl.load(res_ptr + t * stride_rt + i * stride_rh + cols, mask=c_mask, other=0.0).to(tl.float32)
        mixed += c[:, None] * r[None, :]
    out = post[:, None] * f[None, :] + mixed
    # Every copy of this column block was read above, so out may alias residual.
    tl.store(out_ptr + t * stride_ot + j[:, None] * stride_oh + cols[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(j[:, None] < HC) & c_mask[None, :])


def _compiled() -> bool:
    # bf16 dots (see _dot) everywhere but under the interpreter.
    return os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def _check_hc(hc: int) -> None:
    if hc < 1 or hc & (hc - 1):
        raise ValueError(f"mHC kernels need hc to be a power of two, got hc={hc}")


class MixPlan(NamedTuple):
    block_t: int  # tokens per program (>= 16: tl.dot's minimum M)
    block_k: int  # columns of one copy per K tile
    split: int  # programs along K; the workspace holds this many partials per token
    tiles_per_split: int  # K tiles per program (the last split may hold fewer)
    num_warps: int
    num_stages: int = 3


def make_plan(D: int, hc: int, block_t: int, block_k: int, split: int, num_warps: int = 4,
              num_stages: int = 3) -> MixPlan:
    """Spreads hc * cdiv(D, block_k) K tiles over at most `split` programs, none empty."""
    tiles = hc * cdiv(D, block_k)
    per = cdiv(tiles, max(1, min(split, tiles)))
    return MixPlan(block_t, block_k, cdiv(tiles, per), per, num_warps, num_stages)


def _plan(T: int, D: int, hc: int, num_sms: int) -> MixPlan:
    """Tiles by shape (no autotuning: graph capture must not launch candidate configs)."""
    block_t = 16 if T <= 256 else 64
    block_k = max(16, min(64, next_power_of_2(D)))
    token_blocks = cdiv(T, block_t)
    return make_plan(D, hc, block_t, block_k, cdiv(_PROGRAMS_PER_SM * num_sms, token_blocks))


def hc_pre(x, fn, scale, base, hc, iters, hc_eps, norm_eps, y_out=None, rms_weight=None, rms_eps=0.0):
    """x [T, hc, d] -> (y [T, d] x.dtype (y_out if given), post [T, hc], comb [T, hc, hc]).
    rms_weight [d]: y is followed by the sub-layer's RMSNorm (elementwise.rms_norm's formula)
    in the same launch, and the first result is the normed y (y_out then holds it)."""
    _check_hc(hc)
    T, _, D = x.shape
    mix = (2 + hc) * hc
    assert x.shape[1] == hc and x.stride(-1) == 1
    assert fn.shape == (mix, hc * D) and fn.stride(-1) == 1
    assert scale.is_contiguous() and base.is_contiguous() and iters >= 1
    y = y_out if y_out is not None else torch.empty(T, D, dtype=x.dtype, device=x.device)
    assert y.shape == (T, D) and y.stride(-1) == 1
    post = torch.empty(T, hc, dtype=torch.float32, device=x.device)
    comb = torch.empty(T, hc, hc, dtype=torch.float32, device=x.device)
    if T == 0:
        return y, post, comb
    plan = _plan(T, D, hc, sm_count(x.device))
    k_blocks = cdiv(D, plan.block_k)
    assert plan.split * plan.tiles_per_split >= hc * k_blocks
    block_m = max(16, next_power_of_2(mix))
    ws = torch.empty(plan.split, T, block_m, dtype=torch.float32, device=x.device)
    sq = torch.empty(plan.split, T, dtype=torch.float32, device=x.device)
    _hc_mixes_kernel[(cdiv(T, plan.block_t), plan.split)](
        x, x.stride(0), x.stride(1), fn, fn.stride(0), ws, ws.stride(0), sq, sq.stride(0),
        T, D, k_blocks, plan.tiles_per_split,
        MIX=mix, BLOCK_T=plan.block_t, BLOCK_M=block_m, BLOCK_K=plan.block_k, HC=hc,
        X_BF16=x.dtype == torch.bfloat16, X_FP32=x.dtype == torch.float32, DOT_BF16=_compiled(),
        num_warps=plan.num_warps, num_stages=plan.num_stages, **pdl.options(x))
    # BLOCK_S covers a decode step's splits in one pass: a loop over small chunks would pay a
    # memory latency per chunk. y is split over D so a small T still spreads over SMs; with the
    # norm one program writes the row while another does the Sinkhorn. 4 warps either way: 8
    # (the norm kernel's at d = 4096) made the finish 3 µs slower at T = 1 on an H200.
    block_d = min(next_power_of_2(D), 4096 // hc)
    rms = rms_weight is not None
    if rms:
        assert rms_weight.shape == (D,) and rms_weight.stride(-1) == 1
        y_row = torch.empty(T, D, dtype=x.dtype, device=x.device)  # y before the norm
        block_row = next_power_of_2(D)
    else:
        y_row, block_row = y, block_d
    _hc_finish_kernel[(T, 2 if rms else cdiv(D, block_d))](
        x, x.stride(0), x.stride(1), ws, ws.stride(0), sq, sq.stride(0), scale, base,
        y_row, y_row.stride(0), post, post.stride(0), comb, comb.stride(0),
        rms_weight if rms else scale, y, y.stride(0),
        D, plan.split, int(iters), float(hc_eps), float(norm_eps), float(rms_eps),
        HC=hc, BLOCK_M=block_m, BLOCK_S=min(256, max(16, next_power_of_2(plan.split))),
        BLOCK_D=block_d, RMS=rms, BLOCK_ROW=block_row, SINKHORN_PID=1 if rms else 0, num_warps=4, **pdl.options(x))
    return y, post, comb


def hc_post(f, residual, post, comb, out=None):
    """X'_j = post_j * f + sum_i comb[i, j] * X_i -> out [T, hc, d] (may be residual itself)."""
    T, hc, D = residual.shape
    _check_hc(hc)
    out = out if out is not None else torch.empty_like(residual)
    assert f.shape == (T, D) and post.shape == (T, hc) and comb.shape == (T, hc, hc)
    assert f.stride(-1) == 1 and residual.stride(-1) == 1 and out.stride(-1) == 1
    assert post.stride(-1) == 1 and comb.stride(-1) == 1 and out.shape == residual.shape
    if T == 0:
        return out
    block_d = min(next_power_of_2(D), 4096 // hc)
    _hc_post_kernel[(T, cdiv(D, block_d))](
        f, f.stride(0), residual, residual.stride(0), residual.stride(1), post, post.stride(0),
        comb, comb.stride(0), comb.stride(1), out, out.stride(0), out.stride(1), D,
        HC=hc, BLOCK_D=block_d, num_warps=4,
    )
    return out
