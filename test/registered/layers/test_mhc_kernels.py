"""The model's HyperConnection (sgl-kernel's torch reference) against a float64 spec, the
Triton kernels (interpreted on CPU) against the model; and pre/post pick dsv4_kernels' ops
only inside a forward pass whose backend runs segment kernels."""

import types

import pytest
import torch

from dsv4_kernels import ops

from sglang.srt.configs.presets import get_preset
from sglang.srt.layers.mhc import HyperConnection
from sglang.srt.model_executor.forward_context import forward_context


def _hyper_connection(d, seed):
    """The tiny preset's mHC settings with random (non-trivial) parameters."""
    c = get_preset("dsv4-tiny")
    g = torch.Generator().manual_seed(seed)
    hc = HyperConnection(c.hc_mult, d, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps)
    mix = hc.fn.shape[0]
    hc.fn.copy_(torch.randn(mix, c.hc_mult * d, generator=g) * (1.5 / (c.hc_mult * d) ** 0.5))
    hc.base.copy_(torch.randn(mix, generator=g) * 0.5)
    hc.scale.copy_(torch.rand(3, generator=g) + 0.5)
    return hc, g


def _args(hc):
    return hc.fn, hc.scale, hc.base, hc.hc, hc.iters, hc.hc_eps, hc.norm_eps


def _spec(hc, x, f):
    """mHC written out in float64, one token at a time (the model code, the kernels' torch
    reference and the Triton kernels must all agree with it)."""
    H, d = hc.hc, x.shape[-1]
    fn, base, scale = hc.fn.double(), hc.base.double(), hc.scale.double()
    ys, posts, combs, outs = [], [], [], []
    for t in range(x.shape[0]):
        flat = x[t].double().reshape(-1)
        mixes = (fn @ flat) / torch.sqrt((flat * flat).mean() + hc.norm_eps)
        pre = torch.sigmoid(mixes[:H] * scale[0] + base[:H]) + hc.hc_eps
        post = 2 * torch.sigmoid(mixes[H:2 * H] * scale[1] + base[H:2 * H])
        comb = torch.softmax((mixes[2 * H:] * scale[2] + base[2 * H:]).view(H, H), dim=-1) + hc.hc_eps
        comb = comb / (comb.sum(0, keepdim=True) + hc.hc_eps)
        for _ in range(hc.iters - 1):  # rows then columns, ending on columns
            comb = comb / (comb.sum(1, keepdim=True) + hc.hc_eps)
            comb = comb / (comb.sum(0, keepdim=True) + hc.hc_eps)
        xs = x[t].double().view(H, d)
        ys.append((pre[:, None] * xs).sum(0))
        posts.append(post)
        combs.append(comb)
        outs.append(post[:, None] * f[t].double()[None, :] + comb.t() @ xs)
    return torch.stack(ys), torch.stack(posts), torch.stack(combs), torch.stack(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hyper_connection_matches_a_float64_spec(dtype):
    hc, g = _hyper_connection(64, 0)
    x = (torch.randn(9, hc.hc, 64, generator=g) * 2).to(dtype)
    f = torch.randn(9, 64, generator=g).to(dtype)
    y, post, comb = hc.pre(x)
    out = HyperConnection.post(f, x, post, comb)
    y_s, post_s, comb_s, out_s = _spec(hc, x, f)
    assert y.dtype == out.dtype == dtype and post.dtype == comb.dtype == torch.float32
    assert comb_s.std() > 0.02  # comb is not the trivial uniform matrix
    torch.testing.assert_close(post.double(), post_s, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comb.double(), comb_s, rtol=1e-5, atol=1e-6)
    tol = dict(rtol=1e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.double(), y_s, **tol)
    torch.testing.assert_close(out.double(), out_s, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernels_match_hyper_connection(dtype):
    pytest.importorskip("triton")
    from dsv4_kernels import mhc

    device = "cuda" if torch.cuda.is_available() else "cpu"
    hc, g = _hyper_connection(48, 1)  # d not a power of two
    x = (torch.randn(5, hc.hc, 48, generator=g) * 2).to(dtype)
    f = torch.randn(5, 48, generator=g).to(dtype)
    y_ref, post_ref, comb_ref = hc.pre(x)
    out_ref = HyperConnection.post(f, x, post_ref, comb_ref)
    hc.to(device)
    y, post, comb = mhc.hc_pre(x.to(device), *_args(hc))
    out = mhc.hc_post(f.to(device), x.to(device), post, comb)
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(post.cpu(), post_ref, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(comb.cpu(), comb_ref, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(y.cpu().float(), y_ref.float(), **tol)
    torch.testing.assert_close(out.cpu().float(), out_ref.float(), **tol)


@pytest.mark.parametrize("segment_kernels", [True, False])
def test_pre_and_post_use_the_ops_only_under_segment_kernels(monkeypatch, segment_kernels):
    calls = []
    for name in ("hc_pre", "hc_post"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    hc, g = _hyper_connection(64, 2)
    x = torch.randn(3, hc.hc, 64, generator=g)
    f = torch.randn(3, 64, generator=g)
    torch_pre = hc.pre(x)  # outside any forward pass: the torch path
    torch_post = HyperConnection.post(f, x, torch_pre[1], torch_pre[2])
    assert calls == []
    backend = types.SimpleNamespace(segment_kernels=segment_kernels)
    with forward_context(None, backend, num_live_tokens=3):
        got_pre = hc.pre(x)
        got_post = HyperConnection.post(f, x, got_pre[1], got_pre[2])
    assert calls == (["hc_pre", "hc_post"] if segment_kernels else [])
    # On CPU the ops run the reference: identical to the torch path either way.
    for a, b in zip(got_pre + (got_post,), torch_pre + (torch_post,)):
        assert torch.equal(a, b)
