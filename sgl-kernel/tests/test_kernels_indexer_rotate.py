"""The indexer's RoPE + Walsh-Hadamard rotation + FP4 rounding in one kernel (indexer_rotate.py)
against the torch chain it replaces (reference.apply_rope rounded to the row dtype, then
quant_reference.hadamard_rotate and fp4_round_blocks). Under the interpreter on CPU, compiled
on a GPU."""

import pytest
import torch

from dsv4_kernels import ops, reference
from dsv4_kernels import quant_reference as Q
from kernel_test_utils import require_triton, rope_tables

D, ROPE = 128, 64


def _chain(x, cos, sin, pos, rope_dim, rotate=True):
    y = reference.apply_rope(x, cos, sin, pos, rope_dim).to(x.dtype) if rope_dim else x.clone()
    return Q.fp4_round_blocks(Q.hadamard_rotate(y)) if rotate else y


def _e2m1_steps(got, want):
    """How far apart two FP4-rounded tensors are, per element, in steps of their blocks' grid
    (0: equal). The rotation sums 128 terms in another order than the reference's butterflies;
    a last-bit difference moves a value across a rounding boundary only when it sits on one."""
    g, w = got.float().unflatten(-1, (-1, 32)), want.float().unflatten(-1, (-1, 32))
    scale = Q.pow2_scale(w.abs().amax(-1), Q.E2M1_MAX)[..., None]
    return ((g - w).abs() / (0.5 * scale)).flatten(-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,H", [(3, 4), (37, 1), (5, 16)])  # 12, 37, 80 rows: ragged row blocks
def test_rope_rotate_round_matches_the_torch_chain(device, dtype, T, H):
    require_triton()
    from dsv4_kernels import indexer_rotate

    g = torch.Generator().manual_seed(T * 100 + H)
    # spread magnitudes, a few all-zero rows (the amax floor) and an outlier per row
    x = torch.randn(T, H, D, generator=g) * torch.rand(T, H, 1, generator=g) * 4
    x[0, 0] = 0.0
    x[:, :, 5] *= 30
    x = x.to(dtype).to(device)
    cos, sin = rope_tables(4096, ROPE, device=device)
    pos = torch.randint(0, 4096, (T,), generator=g).to(device)
    want = _chain(x, cos, sin, pos, ROPE)
    got = indexer_rotate.rope_rotate_round_(x.clone(), cos, sin, pos, ROPE)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got[0, 0], torch.zeros(D, dtype=dtype, device=device))
    steps = _e2m1_steps(got, want)
    exact_share = (steps == 0).float().mean().item()
    assert torch.equal(Q.fp4_round_blocks(got.float()), got.float())  # every value on its block's FP4 grid
    if dtype == torch.bfloat16 and device == "cpu":
        # the interpreter's fp32 -> bf16 conversion truncates (the kernel's two roundings to
        # the row dtype, before the rotation and before the FP4 step): close, not equal
        rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert exact_share > 0.9 and rel < 0.05, (exact_share, rel)
    else:  # at most one grid step from the reference's, and nearly all equal
        assert steps.max() <= 1.0 + 1e-6 and exact_share > 0.995, (steps.max().item(), exact_share)
    if device == "cuda":  # ops sends CUDA tensors to the kernel
        assert torch.equal(ops.indexer_rope_rotate_round_(x.clone(), cos, sin, pos, ROPE), got)


def test_rope_only_and_rotation_only(device):
    require_triton()
    from dsv4_kernels import indexer_rotate

    g = torch.Generator().manual_seed(7)
    x = torch.randn(9, 4, D, generator=g).to(device)
    cos, sin = rope_tables(512, ROPE, device=device)
    pos = torch.randint(0, 512, (9,), generator=g).to(device)
    # RoPE alone (weight_only numerics): the reference rotation of the last 64 dims
    roped = indexer_rotate.rope_rotate_round_(x.clone(), cos, sin, pos, ROPE, rotate=False)
    torch.testing.assert_close(roped, _chain(x, cos, sin, pos, ROPE, rotate=False), rtol=1e-6, atol=1e-6)
    assert torch.equal(roped[..., :D - ROPE], x[..., :D - ROPE])  # the nope dims untouched
    # the emitted keys: [n, D] rows, no RoPE
    keys = torch.randn(21, D, generator=g).to(device)
    rotated = indexer_rotate.rope_rotate_round_(keys.clone(), rope_dim=0)
    assert (_e2m1_steps(rotated, _chain(keys, None, None, None, 0)) == 0).float().mean() > 0.995


def test_rope_rotate_round_takes_the_columns_of_a_wider_row(device):
    """The indexer's q as columns of a stacked GEMM's output (Fp8RowStack): a token's heads
    sit at a row stride wider than its own H x dim; the result is the contiguous copy's, and
    the other columns are left alone."""
    require_triton()
    from dsv4_kernels import indexer_rotate

    g = torch.Generator().manual_seed(11)
    T, H, other = 5, 4, 96
    wide = torch.randn(T, other + H * D, generator=g).to(torch.bfloat16).to(device)
    cos, sin = rope_tables(256, ROPE, device=device)
    pos = torch.randint(0, 256, (T,), generator=g).to(device)
    want = indexer_rotate.rope_rotate_round_(wide[:, other:].clone().unflatten(-1, (H, D)), cos, sin, pos, ROPE)
    before = wide[:, :other].clone()
    view = wide[:, other:].unflatten(-1, (H, D))
    assert view.stride() == (other + H * D, D, 1)
    indexer_rotate.rope_rotate_round_(view, cos, sin, pos, ROPE)
    assert torch.equal(view, want) and torch.equal(wide[:, :other], before)


def test_rope_rotate_round_refuses_bad_rows(device):
    require_triton()
    from dsv4_kernels import indexer_rotate

    with pytest.raises(ValueError, match="power of two"):
        indexer_rotate.rope_rotate_round_(torch.zeros(2, 96, device=device))
    with pytest.raises(ValueError, match="unit last stride"):
        indexer_rotate.rope_rotate_round_(torch.zeros(2, 4, 256, device=device)[:, :, ::2])
    with pytest.raises(ValueError, match="needs cos"):
        indexer_rotate.rope_rotate_round_(torch.zeros(2, 128, device=device), rope_dim=64)


def test_ops_fall_back_to_the_torch_chain_off_cuda():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(6, 2, D, generator=g).to(torch.bfloat16)
    cos, sin = rope_tables(64, ROPE)
    pos = torch.randint(0, 64, (6,), generator=g)
    assert torch.equal(ops.indexer_rope_rotate_round_(x.clone(), cos, sin, pos, ROPE), _chain(x, cos, sin, pos, ROPE))
