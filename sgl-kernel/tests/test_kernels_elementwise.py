"""The row-wise glue kernels (elementwise.py): RMS norm, clamped SwiGLU, fp32 add, against the
torch chains they replace. Under the interpreter on CPU, compiled on a GPU."""

import pytest
import torch
import torch.nn.functional as F

from dsv4_kernels import ops, reference
from kernel_test_utils import require_triton


def _ulp_close(got, want, dtype):
    """Results rounded to a 16-bit dtype may differ by one rounding step of the fp32 value (the
    sum of squares is summed in another order); fp32 results by a few fp32 ulps."""
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:
        step = torch.finfo(dtype).eps
        err = (got.float() - want.float()).abs()
        assert (err <= step * want.float().abs() + 1e-6).all(), f"max error {err.max().item():.3e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 96), (3, 4, 40), (1, 1024), (0, 64)])
@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_matches_the_torch_norm(device, dtype, shape, with_weight):
    require_triton()
    from dsv4_kernels import elementwise

    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 3 + 0.5).to(dtype).to(device)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(device) if with_weight else None
    got = elementwise.rms_norm(x, w, 1e-6)
    # what layernorm.RMSNorm computes in torch
    xf = x.float()
    want = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6)
    want = (want * w if with_weight else want).to(dtype)
    assert got.dtype == dtype and got.shape == x.shape
    _ulp_close(got, want, dtype)
    if x.is_cuda:  # ops sends CUDA tensors to the kernel, CPU ones to the torch reference
        assert torch.equal(ops.rms_norm(x, w, 1e-6), got)


def test_rms_norm_reads_strided_rows_and_writes_out(device):
    require_triton()
    from dsv4_kernels import elementwise

    base = torch.randn(6, 80, generator=torch.Generator().manual_seed(1)).to(device)
    x = base[:, 8:72]  # rows 80 apart, a column slice
    out = torch.full((6, 64), float("nan"), device=device)
    assert elementwise.rms_norm(x, None, 1e-6, out=out) is out
    _ulp_close(out, reference.rms_norm(x, None, 1e-6), torch.float32)
    with pytest.raises(ValueError, match="weight shape"):
        elementwise.rms_norm(x, torch.ones(63, device=device), 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("limit", [7.0, 0.0])
def test_swiglu_clamped_matches_the_shared_experts_chain(device, dtype, limit):
    require_triton()
    from dsv4_kernels import elementwise

    g = torch.Generator().manual_seed(2)
    both = (torch.randn(9, 2 * 1500, generator=g) * 6).to(dtype).to(device)  # values past the limit
    gate, up = both[:, :1500], both[:, 1500:]  # column slices of one buffer: strided rows
    got = elementwise.swiglu_clamped(gate, up, limit, torch.bfloat16)
    gf, uf = gate.float(), up.float()
    if limit > 0:
        gf, uf = gf.clamp(max=limit), uf.clamp(-limit, limit)
        assert (gate.float() > limit).any() and (up.float().abs() > limit).any()  # the clamp is exercised
    want = (F.silu(gf) * uf).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (9, 1500)
    _ulp_close(got, want, torch.bfloat16)


def test_add_fp32_rounds_the_fp32_sum_once(device):
    require_triton()
    from dsv4_kernels import elementwise

    g = torch.Generator().manual_seed(3)
    a = torch.randn(7, 1100, generator=g).to(device)
    b = torch.randn(7, 1100, generator=g).to(torch.bfloat16).to(device)
    got = elementwise.add_fp32(a, b, torch.bfloat16)
    want = (a + b.float()).to(torch.bfloat16)
    if a.is_cuda:  # one rounding of the exact fp32 sum: torch's chain bit for bit
        assert torch.equal(got, want)
    else:  # the interpreter's fp32 -> bf16 conversion truncates
        _ulp_close(got, want, torch.bfloat16)
    with pytest.raises(ValueError, match="one 2-D shape"):
        elementwise.add_fp32(a, b[:, :10], torch.bfloat16)


def test_ops_fall_back_to_torch_off_cuda():
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    w = torch.rand(32) + 0.5
    want = (w * reference.rms_norm(x, None, 1e-6)).to(torch.bfloat16)
    assert torch.equal(ops.rms_norm(x, w, 1e-6), want)
    gate, up = torch.randn(4, 8), torch.randn(4, 8)
    assert torch.equal(ops.swiglu_clamped(gate, up, 0.5, torch.bfloat16),
                       (F.silu(gate.clamp(max=0.5)) * up.clamp(-0.5, 0.5)).to(torch.bfloat16))
    assert torch.equal(ops.add_fp32(gate, up.to(torch.bfloat16), torch.float32), gate + up.to(torch.bfloat16).float())
