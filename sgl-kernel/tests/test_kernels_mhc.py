"""mHC hc_pre (mixes + RMS scale + Sinkhorn + gated sum) and hc_post, Triton vs reference."""

import pytest
import torch

from dsv4_kernels import ops, reference
from kernel_test_utils import require_triton

HC, ITERS, HC_EPS, NORM_EPS = 4, 20, 1e-6, 1e-6


def _pre_case(T, d, dtype, device, hc=HC):
    """Random residual copies and mHC parameters. fn is scaled so the mixes have std ~1.5 and
    scale/base spread the gates and comb logits: Sinkhorn has real work to do."""
    mix = (2 + hc) * hc
    x = (torch.randn(T, hc, d, device=device) * 2 + 0.3).to(dtype)
    fn = torch.randn(mix, hc * d, device=device) * (1.5 / (hc * d) ** 0.5)
    scale = torch.rand(3, device=device) + 0.5
    base = torch.randn(mix, device=device) * 0.5
    return x, fn, scale, base


def _tol(dtype):
    # bf16 outputs may differ by one rounding step of the fp32 result.
    return dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=2e-5, atol=2e-5)


def test_reference_comb_is_doubly_stochastic_and_y_uses_the_gates():
    x, fn, scale, base = _pre_case(6, 16, torch.float32, "cpu")
    y, post, comb = reference.hc_pre(x, fn, scale, base, HC, 200, HC_EPS, NORM_EPS)
    ones = torch.ones(6, HC)
    torch.testing.assert_close(comb.sum(-1), ones, atol=1e-5, rtol=0)
    torch.testing.assert_close(comb.sum(-2), ones, atol=1e-5, rtol=0)
    assert (comb.std(dim=(1, 2)) > 0.02).all()  # not the uniform matrix: the case is non-trivial
    assert ((post > 0) & (post < 2)).all()
    # y is a positive combination of the copies (gates in (eps, 1 + eps)).
    flat = x.flatten(1)
    mixes = flat @ fn.t() * torch.rsqrt(flat.square().mean(-1, keepdim=True) + NORM_EPS)
    pre = torch.sigmoid(mixes[:, :HC] * scale[0] + base[:HC]) + HC_EPS
    torch.testing.assert_close(y, (pre[:, :, None] * x).sum(1))


def test_reference_post_mixes_columns_and_may_write_in_place():
    T, d = 3, 8
    f, res = torch.randn(T, d), torch.randn(T, HC, d)
    post, comb = torch.rand(T, HC), torch.rand(T, HC, HC)
    expected = post[:, :, None] * f[:, None, :] + torch.einsum("tij,tid->tjd", comb, res)
    torch.testing.assert_close(reference.hc_post(f, res, post, comb), expected)
    torch.testing.assert_close(reference.hc_post(f, res, post, comb, out=res), expected)
    torch.testing.assert_close(res, expected)


# plan: None = the shape's own plan; else (block_t, block_k, split) forced through make_plan.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,d,plan", [
    (1, 64, None), (5, 48, None),
    (37, 24, (16, 16, 3)),  # 3 token blocks, the last ragged; 8 K tiles as 3 + 3 + 2 across copies
    (1, 40, (16, 32, 3)),  # T = 1, split, ragged d (32 + 8) and a ragged last slice
    (19, 40, (32, 16, 5)),  # BLOCK_T 32 over 19 tokens; 12 tiles as 4 x 3
    (11, 24, (16, 16, 1)),  # one split over every tile
])
def test_triton_hc_pre_matches_reference(device, monkeypatch, dtype, T, d, plan):
    require_triton()
    from dsv4_kernels import mhc

    if plan is not None:
        monkeypatch.setattr(mhc, "_plan", lambda T, D, hc, num_sms: mhc.make_plan(D, hc, *plan))
    x, fn, scale, base = _pre_case(T, d, dtype, device)
    y, post, comb = mhc.hc_pre(x, fn, scale, base, HC, ITERS, HC_EPS, NORM_EPS)
    y_ref, post_ref, comb_ref = reference.hc_pre(x, fn, scale, base, HC, ITERS, HC_EPS, NORM_EPS)
    assert y.dtype == dtype and post.dtype == comb.dtype == torch.float32
    assert comb.shape == (T, HC, HC) and post.shape == (T, HC) and y.shape == (T, d)
    torch.testing.assert_close(post, post_ref, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(comb, comb_ref, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(y.float(), y_ref.float(), **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,d,plan", [
    (1, 64, None),  # decode: one program writes the row, another does the Sinkhorn
    (6, 40, (16, 16, 3)),  # a ragged row (40 in a 64-wide block), split mixes
    (3, 1536, None),  # a row of two 1024-column blocks, the second ragged
])
def test_triton_hc_pre_with_the_sublayer_norm_is_the_norm_of_y(device, monkeypatch, dtype, T, d, plan):
    """rms_weight: the first result is RMSNorm(y) * weight in y's dtype (the norm of the y the
    kernel stores), post and comb exactly the unfused call's."""
    require_triton()
    from dsv4_kernels import mhc

    if plan is not None:
        monkeypatch.setattr(mhc, "_plan", lambda T, D, hc, num_sms: mhc.make_plan(D, hc, *plan))
    x, fn, scale, base = _pre_case(T, d, dtype, device)
    w = torch.rand(d, device=device) + 0.5
    y, post, comb = mhc.hc_pre(x, fn, scale, base, HC, ITERS, HC_EPS, NORM_EPS)
    y_out = torch.full((T, d), 7.0, device=device, dtype=dtype)
    yn, post_n, comb_n = mhc.hc_pre(x, fn, scale, base, HC, ITERS, HC_EPS, NORM_EPS, y_out=y_out,
                                    rms_weight=w, rms_eps=1e-5)
    assert yn.data_ptr() == y_out.data_ptr() and yn.dtype == dtype
    assert torch.equal(post_n, post) and torch.equal(comb_n, comb)
    want = reference.rms_norm(y, w, 1e-5).to(dtype)
    torch.testing.assert_close(yn.float(), want.float(), **_tol(dtype))
    # and through ops, whose off-CUDA path is reference.hc_pre then ops.rms_norm
    got_ops = ops.hc_pre(x.cpu(), fn.cpu(), scale.cpu(), base.cpu(), HC, ITERS, HC_EPS, NORM_EPS,
                         rms_weight=w.cpu(), rms_eps=1e-5)[0]
    y_ref = reference.hc_pre(x.cpu(), fn.cpu(), scale.cpu(), base.cpu(), HC, ITERS, HC_EPS, NORM_EPS)[0]
    assert torch.equal(got_ops, ops.rms_norm(y_ref, w.cpu(), 1e-5))


def test_make_plan_spreads_k_tiles_over_splits_none_empty():
    from dsv4_kernels import mhc

    # d = 24 in K tiles of 16: 2 per copy, 8 in all; 3 splits of 3, 3 and 2.
    assert mhc.make_plan(24, HC, 16, 16, 3) == mhc.MixPlan(16, 16, 3, 3, 4)
    # More splits asked than tiles, or splits that would leave one empty: fewer splits.
    assert mhc.make_plan(24, HC, 16, 16, 20).split == 8
    assert mhc.make_plan(40, HC, 16, 16, 5)[2:4] == (4, 3)


@pytest.mark.parametrize("T", [1, 2, 16, 17, 100, 1024, 4096, 8192, 20000])
def test_plan_fills_an_h200_at_flash_shapes(T):
    from dsv4_kernels import mhc

    d, sms = 4096, 132
    plan = mhc._plan(T, d, HC, sms)
    tiles = HC * (d // plan.block_k)
    assert d % plan.block_k == 0 and plan.block_t >= 16
    assert (plan.split - 1) * plan.tiles_per_split < tiles <= plan.split * plan.tiles_per_split
    token_blocks = -(-T // plan.block_t)
    assert token_blocks * plan.split >= sms  # at least one program per SM, even at T = 1
    if token_blocks >= 2 * sms:
        assert plan.split == 1  # the tokens alone fill the GPU: no partials to add
    if T == 1:
        assert plan.split >= 32


def test_triton_hc_pre_writes_y_out_of_a_strided_input(device):
    require_triton()
    from dsv4_kernels import mhc

    # Copies as a stride-0 expand (the model's first layer repeats one embedding) and a y_out
    # that is a column block of a wider buffer.
    T, d = 3, 32
    x = torch.randn(T, 1, d, device=device).expand(T, HC, d)
    _, fn, scale, base = _pre_case(T, d, torch.float32, device)
    wide = torch.full((T, 2 * d), 7.0, device=device)
    y_out = wide[:, d:]
    y, post, comb = mhc.hc_pre(x, fn, scale, base, HC, ITERS, HC_EPS, NORM_EPS, y_out=y_out)
    assert y.data_ptr() == y_out.data_ptr()
    expected = reference.hc_pre(x.contiguous(), fn, scale, base, HC, ITERS, HC_EPS, NORM_EPS)
    torch.testing.assert_close(y_out, expected[0], rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(comb, expected[2], rtol=2e-5, atol=2e-5)
    assert (wide[:, :d] == 7.0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,d", [(1, 64), (6, 40)])
def test_triton_hc_post_matches_reference(device, dtype, T, d):
    require_triton()
    from dsv4_kernels import mhc

    x, fn, scale, base = _pre_case(T, d, dtype, device)
    _, post, comb = reference.hc_pre(x, fn, scale, base, HC, ITERS, HC_EPS, NORM_EPS)
    f = torch.randn(T, d, device=device).to(dtype)
    expected = reference.hc_post(f, x, post, comb)
    got = mhc.hc_post(f, x, post, comb)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.float(), expected.float(), **_tol(dtype))
    mhc.hc_post(f, x, post, comb, out=x)  # in place over the residual
    torch.testing.assert_close(x.float(), expected.float(), **_tol(dtype))


def test_triton_rejects_hc_that_is_not_a_power_of_two(device):
    require_triton()
    from dsv4_kernels import mhc

    x, fn, scale, base = _pre_case(2, 16, torch.float32, device, hc=3)
    with pytest.raises(ValueError, match="power of two"):
        mhc.hc_pre(x, fn, scale, base, 3, ITERS, HC_EPS, NORM_EPS)
    with pytest.raises(ValueError, match="power of two"):
        mhc.hc_post(torch.randn(2, 16), x, torch.rand(2, 3), torch.rand(2, 3, 3))


def test_ops_dispatch_to_the_reference_off_cuda(monkeypatch):
    def no_kernel_module(name):
        raise AssertionError(f"CPU tensors reached the Triton module {name!r}")

    monkeypatch.setattr(ops, "_kernels", no_kernel_module)
    x, fn, scale, base = _pre_case(2, 16, torch.float32, "cpu")
    got = ops.hc_pre(x, fn, scale, base, HC, ITERS, HC_EPS, NORM_EPS)
    expected = reference.hc_pre(x, fn, scale, base, HC, ITERS, HC_EPS, NORM_EPS)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    f = torch.randn(2, 16)
    assert torch.equal(ops.hc_post(f, x, got[1], got[2]), reference.hc_post(f, x, got[1], got[2]))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 257, 4096])
def test_gpu_real_shapes_match_reference(T):
    d, dtype = 4096, torch.bfloat16
    x, fn, scale, base = _pre_case(T, d, dtype, "cuda")
    y, post, comb = ops.hc_pre(x, fn, scale, base, HC, ITERS, HC_EPS, NORM_EPS)
    y_ref, post_ref, comb_ref = reference.hc_pre(x, fn, scale, base, HC, ITERS, HC_EPS, NORM_EPS)
    # The reference's fp32 linear may run in TF32 if a caller enabled it; allow for that.
    torch.testing.assert_close(post, post_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(comb, comb_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=1e-2, atol=2e-2)
    f = torch.randn(T, d, device="cuda").to(dtype)
    out = ops.hc_post(f, x, post_ref, comb_ref)
    torch.testing.assert_close(out.float(), reference.hc_post(f, x, post_ref, comb_ref).float(),
                               rtol=1e-2, atol=2e-2)
    # Capturable (hc_pre's two launches and its workspace, hc_post's launch): replaying a
    # graph of both reproduces the eager results.
    y_buf = torch.empty(T, d, dtype=dtype, device="cuda")
    out_buf = torch.empty_like(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, p, c = ops.hc_pre(x, fn, scale, base, HC, ITERS, HC_EPS, NORM_EPS, y_out=y_buf)
        ops.hc_post(f, x, p, c, out=out_buf)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y_buf, y)
    torch.testing.assert_close(out_buf.float(), out.float(), rtol=1e-2, atol=2e-2)
