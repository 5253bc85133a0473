"""moe_act.py: the activation rounding before an external MoE's first GEMM and the fused
SwiGLU + routing weight + FP8 rounding between its two GEMMs, against quant_reference's
formulas (the release's numerics). Under the interpreter on CPU, compiled on a GPU."""

import pytest
import torch

from dsv4_kernels import quant_reference as qr
from kernel_test_utils import require_triton


@pytest.mark.parametrize("shape", [(1, 128), (7, 384), (3, 2048), (0, 256)])
def test_quantize_rows_gives_the_release_values_in_row_major_scales(device, shape):
    require_triton()
    from dsv4_kernels.moe_act import quantize_rows

    x = (torch.randn(shape) * torch.logspace(-3, 2, shape[1])).to(torch.bfloat16).to(device)
    q, s = quantize_rows(x)
    want_q, want_s = qr.quantize_fp8_blocks(x.float().cpu())
    assert q.dtype == torch.float8_e4m3fn and q.shape == shape
    assert s.shape == (shape[0], shape[1] // 128) and s.stride() == (shape[1] // 128, 1)
    assert torch.equal(s.cpu(), want_s)
    assert torch.equal(q.cpu().view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("T,topk,E,K,block_m", [(1, 6, 256, 512, 16), (5, 6, 64, 384, 16), (40, 2, 8, 1024, 64)])
def test_align_and_quantize_is_the_two_steps_in_one_launch(device, monkeypatch, T, topk, E, K, block_m):
    """align_and_quantize gives moe_align's sorted list, block experts and used count and
    quantize_rows' codes and scales, bit for bit; with the one-program sort off (large
    batches) it is the two separate steps."""
    require_triton()
    from dsv4_kernels import moe
    from dsv4_kernels.moe_act import align_and_quantize, quantize_rows

    ids = torch.randint(-1, E, (T, topk), dtype=torch.int32, device=device)
    x = (torch.randn(T, K) * torch.logspace(-2, 2, K)).to(torch.bfloat16).to(device)
    want = moe.moe_align(ids, E, block_m, return_used=True), quantize_rows(x)
    for one_program in (True, False):
        if not one_program:
            monkeypatch.setattr(moe, "ALIGN_ONE_KERNEL_MAX_M", 0)
        (sorted_ids, block_expert, used), (q, s) = align_and_quantize(ids, E, block_m, x)
        assert torch.equal(sorted_ids, want[0][0]) and torch.equal(block_expert, want[0][1])
        assert int(used) == int(want[0][2])
        assert torch.equal(q.view(torch.uint8), want[1][0].view(torch.uint8)) and torch.equal(s, want[1][1])


def _swiglu_weight_ref(gu, weights, limit, act_dtype, fp8):
    I = gu.shape[1] // 2
    h = (qr.swiglu_clamped(gu[:, :I], gu[:, I:], limit) * weights.float()[:, None]).to(act_dtype)
    return qr.quantize_fp8_blocks(h.float()) if fp8 else (h, None)


@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("limit", [0.0, 7.0])
@pytest.mark.parametrize("M,I", [(1, 128), (6, 256), (13, 1024), (0, 128)])
def test_swiglu_weight_quant_matches_the_reference_step(device, fp8, limit, M, I):
    require_triton()
    from dsv4_kernels.moe_act import swiglu_weight_quant

    gu = (torch.randn(M, 2 * I) * 6).to(torch.bfloat16)
    weights = torch.rand(M) * 2
    if M > 1:
        weights[1] = 0.0  # a skipped or zero-weight row stays finite
    h, s = swiglu_weight_quant(gu.to(device), weights.to(device), limit, torch.bfloat16, fp8)
    want_h, want_s = _swiglu_weight_ref(gu, weights, limit, torch.bfloat16, fp8)
    assert h.shape == (M, I)
    if fp8:
        assert h.dtype == torch.float8_e4m3fn and s.shape == (M, I // 128)
        assert torch.equal(s.cpu(), want_s)
    else:
        assert h.dtype == torch.bfloat16 and s is None
    # silu's exp may differ from torch's by an fp32 ulp, which can move the bf16 rounding (and
    # then an e4m3 code) by one step in rare rows; values are compared, so -0 equals +0
    got, want = h.cpu().float(), want_h.float()
    assert (got != want).float().sum() <= max(1, got.numel() // 1000)
    step = (2 ** -3 if fp8 else 2 ** -7) * want.abs()  # one e4m3 / bf16 step
    assert ((got - want).abs() <= step + 1e-30).all()
    assert torch.isfinite(h.cpu().float()).all()


def test_swiglu_weight_quant_rejects_shapes_it_cannot_round():
    require_triton()
    from dsv4_kernels.moe_act import swiglu_weight_quant

    with pytest.raises(ValueError, match="fp8 needs I % 128"):
        swiglu_weight_quant(torch.zeros(2, 192), torch.zeros(2), 0.0, torch.bfloat16, True)
    with pytest.raises(ValueError, match="weights"):
        swiglu_weight_quant(torch.zeros(2, 256), torch.zeros(3), 0.0, torch.bfloat16, True)
