"""Triton kernels for the manifold-constrained hyper-connections (mHC), one launch per call.

hc_pre: per token, the (2 + hc) * hc mixes of the RMS-normalised flattened residual copies,
the sigmoid gates, the Sinkhorn projection of the hc x hc comb matrix (in registers), and
the gated sum of the copies. In torch that is ~90 launches, mostly the Sinkhorn loop.
hc_post: X'_j = post_j * f + sum_i comb[i, j] * X_i.

Math is fp32 throughout (as in reference.py); only y / out are cast to the activation dtype.
Outputs are allocated with static shapes and nothing syncs, so both are graph capturable.
"""

import torch
import triton
import triton.language as tl

from .host_math import cdiv, next_power_of_2

# Elements of the [BLOCK_T, BLOCK_M, BLOCK_K] product accumulator of the mixes: 32 fp32
# registers per thread at 8 warps.
_ACC_ELEMS = 8192
_NUM_WARPS = 8


@triton.jit
def _hc_pre_kernel(
    x_ptr, stride_xt, stride_xh, fn_ptr, stride_fn, scale_ptr, base_ptr,
    y_ptr, stride_yt, post_ptr, stride_pt, comb_ptr, stride_ct,
    T, D, iters, hc_eps, norm_eps,
    HC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    MIX: tl.constexpr = (2 + HC) * HC
    pid = tl.program_id(0)
    first_tok = pid.to(tl.int64) * BLOCK_T
    toks = first_tok + tl.arange(0, BLOCK_T)
    tok_mask = toks < T
    m = tl.arange(0, BLOCK_M)
    k = tl.arange(0, BLOCK_K)

    # Pass 1: all MIX dot products and the sum of squares, over the hc * D flattened inputs.
    # A block of tokens shares each fn tile, so fn (MIX x hc*D fp32, 1.5 MiB at d=4096) is
    # read once per block rather than once per token.
    x_rows = x_ptr + toks[:, None] * stride_xt
    fn_rows = fn_ptr + m[:, None] * stride_fn
    acc = tl.zeros([BLOCK_T, BLOCK_M, BLOCK_K], dtype=tl.float32)
    sq = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    for h in tl.static_range(HC):
        for d0 in range(0, D, BLOCK_K):
            kk = d0 + k
            k_mask = kk < D
            xv = tl.load(x_rows + h * stride_xh + kk[None, :],
                         mask=tok_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            w = tl.load(fn_rows + h * D + kk[None, :],
                        mask=(m[:, None] < MIX) & k_mask[None, :], other=0.0).to(tl.float32)
            acc += xv[:, None, :] * w[None, :, :]
            sq += xv * xv
    inv_rms = tl.rsqrt(tl.sum(sq, axis=1) / (HC * D) + norm_eps)
    mixes = tl.sum(acc, axis=2) * inv_rms[:, None]  # [BLOCK_T, BLOCK_M]

    # Column selectors: mixes are [pre (hc) | post (hc) | comb (hc*hc, row-major)].
    i = tl.arange(0, HC)
    j = tl.arange(0, HC)
    ij = i[:, None] * HC + j[None, :]
    sel_pre = m[None, :] == i[:, None]
    sel_post = m[None, :] == (HC + i)[:, None]
    sel_comb = m[None, None, :] == (2 * HC + ij)[:, :, None]
    s_pre = tl.load(scale_ptr)
    s_post = tl.load(scale_ptr + 1)
    s_comb = tl.load(scale_ptr + 2)
    b_pre = tl.load(base_ptr + i)
    b_post = tl.load(base_ptr + HC + i)
    b_comb = tl.load(base_ptr + 2 * HC + ij)
    rows = tl.arange(0, BLOCK_T)
    dd = tl.arange(0, BLOCK_D)

    # Pass 2, token by token: gates, Sinkhorn, then y from a second read of the token's
    # copies (still in L1/L2 from pass 1).
    for r in tl.static_range(BLOCK_T):
        tok = first_tok + r
        mt = tl.sum(tl.where(rows[:, None] == r, mixes, 0.0), axis=0)  # [BLOCK_M]
        pre = tl.sigmoid(tl.sum(tl.where(sel_pre, mt[None, :], 0.0), axis=1) * s_pre + b_pre) + hc_eps
        post = 2.0 * tl.sigmoid(tl.sum(tl.where(sel_post, mt[None, :], 0.0), axis=1) * s_post + b_post)
        logits = tl.sum(tl.where(sel_comb, mt[None, None, :], 0.0), axis=2) * s_comb + b_comb
        e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        comb = e / tl.sum(e, axis=1)[:, None] + hc_eps
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
        # Same order as the reference: (iters - 1) x [rows, columns], ending on columns.
        for _ in range(iters - 1):
            comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
            comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)

        # Masks are built as vectors: the interpreter rejects scalar-bool & vector-bool.
        ok_i = (i * 0 + tok) < T
        tl.store(post_ptr + tok * stride_pt + i, post, mask=ok_i)
        tl.store(comb_ptr + tok * stride_ct + ij, comb, mask=(ij * 0 + tok) < T)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + dd
            c_mask = cols < D
            xv = tl.load(x_ptr + tok * stride_xt + i[:, None] * stride_xh + cols[None, :],
                         mask=ok_i[:, None] & c_mask[None, :], other=0.0).to(tl.float32)
            yv = tl.sum(pre[:, None] * xv, axis=0)
            tl.store(y_ptr + tok * stride_yt + cols, yv.to(y_ptr.dtype.element_ty),
                     mask=c_mask & ((cols * 0 + tok) < T))


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


def _check_hc(hc: int) -> None:
    if hc < 1 or hc & (hc - 1):
        raise ValueError(f"mHC kernels need hc to be a power of two, got hc={hc}")


def _block_t(T: int) -> int:
    # Few tokens: one per program spreads fn's reads over more SMs. Many: share fn tiles.
    return 1 if T <= 128 else (2 if T <= 512 else 4)


def hc_pre(x, fn, scale, base, hc, iters, hc_eps, norm_eps, y_out=None):
    """x [T, hc, d] -> (y [T, d] x.dtype (y_out if given), post [T, hc], comb [T, hc, hc])."""
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
    block_t = _block_t(T)
    block_m = next_power_of_2(mix)
    block_k = max(16, min(next_power_of_2(D), _ACC_ELEMS // (block_t * block_m)))
    block_d = min(next_power_of_2(D), 4096 // hc)
    _hc_pre_kernel[(cdiv(T, block_t),)](
        x, x.stride(0), x.stride(1), fn, fn.stride(0), scale, base,
        y, y.stride(0), post, post.stride(0), comb, comb.stride(0),
        T, D, int(iters), float(hc_eps), float(norm_eps),
        HC=hc, BLOCK_T=block_t, BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_D=block_d,
        num_warps=_NUM_WARPS,
    )
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
