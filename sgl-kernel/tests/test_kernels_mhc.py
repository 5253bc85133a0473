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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,d,block_t", [(1, 64, None), (5, 48, None), (7, 40, 4), (11, 24, 2)])
def test_triton_hc_pre_matches_reference(device, monkeypatch, dtype, T, d, block_t):
    require_triton()
    from dsv4_kernels import mhc

    if block_t is not None:  # multi-token programs, with a ragged last block
        monkeypatch.setattr(mhc, "_block_t", lambda _: block_t)
    x, fn, scale, base = _pre_case(T, d, dtype, device)
    y, post, comb = mhc.hc_pre(x, fn, scale, base, HC, ITERS, HC_EPS, NORM_EPS)
    y_ref, post_ref, comb_ref = reference.hc_pre(x, fn, scale, base, HC, ITERS, HC_EPS, NORM_EPS)
    assert y.dtype == dtype and post.dtype == comb.dtype == torch.float32
    assert comb.shape == (T, HC, HC) and post.shape == (T, HC) and y.shape == (T, d)
    torch.testing.assert_close(post, post_ref, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(comb, comb_ref, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(y.float(), y_ref.float(), **_tol(dtype))


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
@pytest.mark.parametrize("T", [1, 257])
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
    # One launch each, capturable: replaying a graph of both reproduces the eager results.
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
