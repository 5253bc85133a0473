"""fp8_scaled_mm (cuBLAS block-scaled FP8 linear) on the CPU: which calls may take cuBLAS, the
weight-scale layout cuBLAS reads, the probe's verdicts, and the route's glue (row padding, the
scale layouts handed over, the slice back) with the GEMM replaced by an emulator that reads
the scales the way cuBLASLt does: from the base pointer with fixed leading dimensions (M for
the activations' scales, L4 for the weight's), not from the tensors' strides. The GPU half
(the real cuBLAS call, graph capture) is in test_kernels_fp8_gemm.py.
"""

import pytest
import torch

from dsv4_kernels import fp8_scaled_mm as S
from dsv4_kernels import ops
from dsv4_kernels import quant_reference as Q
from kernel_test_utils import require_triton


def _contract_mm(q, s, weight, scale_b, out_dtype, ld_b=None):
    """cuBLASLt's 1x128 x 128x128 product as the contract states it. ld_b: the leading
    dimension used to read scale_b (default L4; the unpadded L reproduces the silent bug)."""
    M, K = q.shape
    N, L = weight.shape[0], K // 128
    L4 = S.round_up(L, 4)
    assert q.dtype == S.FP8 and q.is_contiguous() and M % 4 == 0, (q.dtype, q.shape)
    assert tuple(s.shape) == (M, L) and s.stride(0) == 1 and (L == 1 or s.stride(1) == M)
    assert scale_b.shape[1] == N // 128 and scale_b.shape[0] in (L, L4)
    sa = torch.as_strided(s, (M, L), (1, M), s.storage_offset())
    sb = torch.as_strided(scale_b, (N // 128, L), (ld_b or L4, 1), scale_b.storage_offset())
    a = q.float() * sa.repeat_interleave(128, 1)
    w = weight.float() * sb.repeat_interleave(128, 0).repeat_interleave(128, 1)
    return (a @ w.t()).to(out_dtype)


@pytest.mark.parametrize("L,nb", [(1, 3), (3, 2), (4, 2), (5, 1), (8, 3)])
def test_weight_scale_layout_is_cublas_l4_layout(L, nb):
    ws = 2.0 ** torch.randint(-6, 6, (nb, L)).float()
    layout = S.weight_scale_layout(ws)
    L4 = S.round_up(L, 4)
    assert layout.shape == (L4, nb) and layout.dtype == torch.float32
    if nb > 1:
        assert layout.stride() == (1, L4)
    # What cuBLAS reads (block (n, l) at l + n * L4 from the base pointer) is ws, then zeros.
    raw = torch.as_strided(layout, (nb, L4), (L4, 1), layout.storage_offset())
    assert torch.equal(raw[:, :L], ws)
    assert torch.equal(raw[:, L:], torch.zeros(nb, L4 - L))
    # Whole groups of 4 blocks: the weight's own scales, no copy to build or keep.
    assert (layout.data_ptr() == ws.data_ptr()) == (L % 4 == 0)
    with pytest.raises(ValueError, match="expected \\[N/128, K/128\\]"):
        S.weight_scale_layout(ws[0])


def _weight(N, K, device="cpu"):
    q, s = Q.quantize_fp8_weight(torch.randn(N, K) / K ** 0.5)
    return q.to(device), s.to(device)


@pytest.mark.parametrize("act_quant,dtype,N,K,strided,reason", [
    (False, torch.bfloat16, 256, 512, False, "weight-only numerics"),
    (True, torch.float32, 256, 512, False, "x is torch.float32"),
    (True, torch.bfloat16, 200, 512, False, "weight 200 x 512 is not whole"),
    (True, torch.float16, 256, 512, True, "not a contiguous"),
    (True, torch.bfloat16, 256, 384, False, "x is on cpu, not CUDA"),
    (True, torch.float16, 256, 512, False, "x is on cpu, not CUDA"),
])
def test_refusal_names_why_a_call_stays_on_triton(act_quant, dtype, N, K, strided, reason):
    w, _ = _weight(2 * N if strided else N, K)
    if strided:
        w = w[::2]  # every other row: not contiguous
    x = torch.randn(3, K).to(dtype)
    assert reason in S.refusal(x, w, act_quant)
    assert S.use_cublas(x, w, act_quant, "auto") is False
    assert S.use_cublas(x, w, act_quant, "triton") is False
    with pytest.raises(ValueError, match=f"backend='cublas' cannot run this call: .*{reason}"):
        S.use_cublas(x, w, act_quant, "cublas")


def test_bad_backends_are_refused():
    w, s = _weight(256, 512)
    x = torch.randn(2, 512).bfloat16()
    with pytest.raises(ValueError, match="backend must be one of"):
        S.use_cublas(x, w, True, "cutlass")
    with pytest.raises(ValueError, match="needs CUDA tensors"):  # CPU: the reference runs
        ops.fp8_block_linear(x, w, s, True, backend="cublas")
    assert torch.equal(ops.fp8_block_linear(x, w, s, True, backend="triton"),
                       Q.fp8_block_linear_ref(x, w, s, True))
    require_triton()
    from dsv4_kernels import fp8_gemm
    with pytest.raises(ValueError, match="backend must be one of"):
        fp8_gemm.fp8_block_linear(x, w, s, True, backend="cutlass")
    with pytest.raises(ValueError, match="tile config was given with backend='cublas'"):
        fp8_gemm.fp8_block_linear(x, w, s, True, config=fp8_gemm.gemm_config(2, 256, 512, True),
                                  backend="cublas")
    with pytest.raises(ValueError, match="x is on cpu, not CUDA"):
        fp8_gemm.fp8_block_linear(x, w, s, True, backend="cublas")


@pytest.mark.parametrize("padded", [False, True])
def test_probe_passes_the_contract_and_fails_a_misread_layout(monkeypatch, padded):
    monkeypatch.setattr(S, "block_scaled_mm", _contract_mm)
    assert S._probe(torch.device("cpu"), torch.bfloat16, padded) is None
    assert S._probe(torch.device("cpu"), torch.float16, padded) is None
    # cuBLAS reading the scales with the unpadded leading dimension (torch._scaled_mm's check
    # before PR 166752): only the padded probe can see it, and it must.
    monkeypatch.setattr(S, "block_scaled_mm",
                        lambda q, s, w, sb, dt: _contract_mm(q, s, w, sb, dt, ld_b=s.shape[1]))
    verdict = S._probe(torch.device("cpu"), torch.bfloat16, padded)
    assert (verdict is None) == (not padded)
    if padded:
        assert verdict.startswith("wrong result")

    def refuse(*args):
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED\nmore")

    monkeypatch.setattr(S, "block_scaled_mm", refuse)
    assert S._probe(torch.device("cpu"), torch.bfloat16, padded) == \
        "RuntimeError: CUBLAS_STATUS_NOT_SUPPORTED"


def test_probe_verdict_is_cached_per_key(monkeypatch):
    calls = []

    def probe(device, dtype, padded):
        calls.append((device.type, dtype, padded))
        return None if dtype == torch.bfloat16 else "no fp16 here"

    monkeypatch.setattr(S, "_probe", probe)
    monkeypatch.setattr(S, "_SUPPORT", {})
    monkeypatch.setattr(S, "_FAILURES", {})
    for _ in range(3):
        assert S.device_supports("cpu", torch.bfloat16, True) is True
        assert S.device_supports("cpu", torch.float16, True) is False
    assert calls == [("cpu", torch.bfloat16, True), ("cpu", torch.float16, True)]
    assert S.probe_failures() == {("cpu", -1, torch.float16, True): "no fp16 here"}


def test_quantize_act_pads_rows_with_zeros(device):
    require_triton()
    from dsv4_kernels import fp8_act_quant
    x = torch.randn(5, 384) * 3
    q, s = fp8_act_quant.quantize_act(x.to(device), rows=8)
    q, s = q.cpu(), s.cpu()
    q_ref, s_ref = Q.quantize_fp8_blocks(x)
    assert q.shape == (8, 384) and s.shape == (8, 3) and s.stride() == (1, 8)
    assert torch.equal(q[:5].view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(s[:5], s_ref)
    assert not q[5:].view(torch.uint8).any()  # e4m3 +0
    assert torch.isfinite(s[5:]).all() and (s[5:] > 0).all()
    with pytest.raises(ValueError, match="rows=4 is fewer than x's 5"):
        fp8_act_quant.quantize_act(x.to(device), rows=4)


@pytest.mark.parametrize("K", [384, 512])  # K/128 = 3 (padded scales) and 4 (the view)
@pytest.mark.parametrize("lead", [(6,), (2, 3), (1,)])  # M = 6 and 1: rows padded to 8 / 4
def test_cublas_route_pads_rows_hands_the_contract_layouts_and_slices(monkeypatch, device, K,
                                                                      lead):
    require_triton()
    from dsv4_kernels import fp8_gemm
    seen = []

    def mm(q, s, w, sb, dt):
        seen.append(q.shape[0])
        return _contract_mm(q, s, w, sb, dt)

    monkeypatch.setattr(S, "use_cublas", lambda *args: True)
    monkeypatch.setattr(S, "block_scaled_mm", mm)
    w, ws = _weight(256, K, device)
    x = torch.randn(*lead, K, device=device).bfloat16()
    y = fp8_gemm.fp8_block_linear(x, w, ws, True)
    assert y.shape == (*lead, 256) and y.dtype == torch.bfloat16 and y.is_contiguous()
    assert seen == [S.round_up(x[..., 0].numel(), 4)]
    torch.testing.assert_close(y.float(), Q.fp8_block_linear_ref(x.float(), w, ws, True),
                               rtol=2 ** -7, atol=1e-4)
    # A layout built once and passed in gives the same; a wrong one is named.
    layout = S.weight_scale_layout(ws)
    assert torch.equal(fp8_gemm.fp8_block_linear(x, w, ws, True, cublas_scale=layout), y)
    for wrong in (ws, layout.contiguous()):  # the weight's own shape; the right shape row-major
        with pytest.raises(ValueError, match="cublas_scale must be weight_scale_layout"):
            fp8_gemm.fp8_block_linear(x, w, ws, True, cublas_scale=wrong)
