"""The one-row bf16 GEMV with fp32 sums (bf16_gemv.py) against the torch reference.

Its products are exact in fp32 (bf16 x bf16), so it differs from the fp32 GEMM only in the
order of its fp32 sums: rtol 1e-5 on random data, equality where every partial sum is exact.
"""

import pytest
import torch

from dsv4_kernels import ops, reference
from kernel_test_utils import require_triton


def _bf16(*shape, device, scale=1.0):
    return (torch.randn(*shape) * scale).to(device=device, dtype=torch.bfloat16)


@pytest.mark.parametrize("N,K,repeat", [
    (200, 512, 1),   # the router's logits at small dims; a ragged last program
    (64, 256, 1),    # the indexer's head weights
    (96, 256, 3),    # a compressor's split weight: x repeated along K for the three terms
    (33, 4096, 3),   # slabs of 2048 columns: two per term
])
def test_gemv_matches_the_fp32_gemm(device, N, K, repeat):
    require_triton()
    from dsv4_kernels import bf16_gemv
    x = _bf16(1, K, device=device)
    w = _bf16(N, repeat * K, device=device, scale=0.05)
    got = bf16_gemv.bf16_gemv(x, w)
    want = torch.cat([x.float()] * repeat, dim=-1) @ w.float().t()
    assert got.shape == (1, N) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.cpu(), reference.bf16_gemv(x.cpu(), w.cpu()), rtol=1e-5, atol=1e-5)


def test_split_weight_gives_the_fp32_weights_product(device):
    """Three bf16 terms hold an fp32 weight exactly, so the GEMV over them is x times the fp32
    weight (what the compressors ask of it)."""
    require_triton()
    from dsv4_kernels import bf16_gemv
    K, N = 256, 48
    w32 = torch.randn(N, K) * 0.1
    parts, rest = [], w32
    for _ in range(3):
        parts.append(rest.to(torch.bfloat16))
        rest = rest - parts[-1].float()
    split = torch.cat(parts, dim=1).to(device)
    x = _bf16(1, K, device=device)
    got = bf16_gemv.bf16_gemv(x, split)
    torch.testing.assert_close(got.cpu(), x.float().cpu() @ w32.t(), rtol=1e-5, atol=1e-6)


def test_exact_sums_round_and_scale_like_a_bf16_linear(device):
    """Small integers: every sum is exact, so the kernel equals a bf16 linear followed by
    `.float() * scale` bit for bit, also under the leading dims of x ([1, 1, K])."""
    require_triton()
    from dsv4_kernels import bf16_gemv
    K, N = 512, 70
    g = torch.Generator().manual_seed(1)
    x = torch.randint(-2, 3, (1, 1, K), generator=g).to(device=device, dtype=torch.bfloat16)
    w = torch.randint(-1, 2, (N, K), generator=g).to(device=device, dtype=torch.bfloat16)
    want = (x.float() @ w.float().t()).to(torch.bfloat16).float() * 0.125
    got = bf16_gemv.bf16_gemv(x, w, scale=0.125, round_bf16=True)
    assert got.shape == (1, 1, N)
    assert torch.equal(got, want)
    assert torch.equal(ops.bf16_gemv(x.cpu(), w.cpu(), 0.125, True), want.cpu())  # the reference path


def test_rows_per_program_do_not_change_the_sums(device):
    require_triton()
    from dsv4_kernels import bf16_gemv
    x, w = _bf16(1, 1024, device=device), _bf16(256, 2048, device=device)
    base = bf16_gemv.bf16_gemv(x, w, config=dict(BLOCK_N=1, BLOCK_K=1024, num_warps=4))
    for bn in (2, 8):
        assert torch.equal(bf16_gemv.bf16_gemv(x, w, config=dict(BLOCK_N=bn, BLOCK_K=1024, num_warps=4)), base)


def test_calls_it_does_not_take_are_refused_and_left_to_the_caller(device):
    require_triton()
    from dsv4_kernels import bf16_gemv
    assert bf16_gemv.fits(1, 4096, 3 * 4096)
    assert not bf16_gemv.fits(2, 4096, 4096)  # two rows: the tensor-core GEMM's
    assert not bf16_gemv.fits(1, 4096, 4096 + 128)  # not whole repeats of K
    assert not bf16_gemv.fits(1, 1000, 1000)  # not whole slabs
    with pytest.raises(ValueError, match="do not fit"):
        bf16_gemv.bf16_gemv(_bf16(2, 256, device=device), _bf16(8, 256, device=device))
    with pytest.raises(ValueError, match="bf16"):
        bf16_gemv.bf16_gemv(_bf16(1, 256, device=device).float(), _bf16(8, 256, device=device))
    # ops only takes CUDA rows; on the CPU the callers keep their own GEMM
    x, w = _bf16(1, 256, device=device), _bf16(8, 256, device=device)
    assert ops.bf16_gemv_takes(x, w) == (x.is_cuda and ops.triton_available())
    assert not ops.bf16_gemv_takes(_bf16(4, 256, device=device), w)
