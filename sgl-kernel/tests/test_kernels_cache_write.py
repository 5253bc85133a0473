"""RMSNorm + interleaved RoPE + cache write, q RMS/RoPE, and inverse RoPE."""

import pytest
import torch

from dsv4_kernels import ops, reference
from kernel_test_utils import require_triton, rope_tables

# Two positions: angle 0 and angle pi/2 for the single rope pair.
COS = torch.tensor([[1.0], [0.0]])
SIN = torch.tensor([[0.0], [1.0]])


def test_reference_norm_weight_then_rope_on_the_last_pair():
    kv = torch.tensor([[3.0, -3.0, 3.0, 3.0], [3.0, -3.0, 3.0, 3.0]])
    pool = torch.full((4, 4), 7.0)
    kv_out = torch.empty(2, 4)
    reference.rmsnorm_rope_store(kv, torch.tensor([1.0, 2.0, 3.0, 4.0]), 0.0, COS, SIN,
                                 torch.tensor([0, 1]), 2, pool, torch.tensor([2, -1]), kv_out)
    # rms 3 -> [1,-1,1,1] -> weight -> [1,-2,3,4]; position 1 turns (3,4) into (-4,3).
    torch.testing.assert_close(kv_out, torch.tensor([[1.0, -2.0, 3.0, 4.0], [1.0, -2.0, -4.0, 3.0]]))
    torch.testing.assert_close(pool[2], torch.tensor([1.0, -2.0, 3.0, 4.0]))
    assert (pool[[0, 1, 3]] == 7.0).all()  # -1: the second token wrote nothing


def test_reference_store_of_only_padding_tokens_changes_nothing():
    # The reference keeps static shapes (for the CPU graph emulator): padding tokens still go
    # through index_copy_, and must leave the pool as it was.
    pool = torch.randn(3, 4)
    before = pool.clone()
    reference.rmsnorm_rope_store(torch.randn(2, 4), torch.rand(4), 1e-6, COS, SIN,
                                 torch.tensor([0, 1]), 2, pool, torch.tensor([-1, -1]))
    assert torch.equal(pool, before)


def test_reference_inverse_rope_turns_back():
    o = torch.tensor([[[1.0, -2.0, -4.0, 3.0]]])
    reference.inverse_rope_(o, COS, SIN, torch.tensor([1]), 2)
    torch.testing.assert_close(o, torch.tensor([[[1.0, -2.0, 3.0, 4.0]]]))


def _cache_write_case(device, T=9, D=64, rope_dim=16, S=20, max_pos=300):
    kv = torch.randn(T, D, device=device) * 3 + 1
    weight = torch.rand(D, device=device) + 0.5
    cos, sin = rope_tables(max_pos, rope_dim, device=device)
    positions = torch.randint(0, max_pos, (T,), device=device)
    out_loc = torch.randperm(S, device=device)[:T].to(torch.int32)
    out_loc[[1, T - 1]] = -1
    return kv, weight, cos, sin, positions, out_loc


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_triton_rmsnorm_rope_store_matches_reference(device, pool_dtype):
    require_triton()
    from dsv4_kernels import cache_write

    kv, weight, cos, sin, positions, out_loc = _cache_write_case(device)
    pools, outs = [], []
    for impl in (reference, cache_write):
        pool = torch.randn(20, 64, device=device).to(pool_dtype)
        kv_out = torch.empty(kv.shape, device=device)
        impl.rmsnorm_rope_store(kv, weight, 1e-6, cos, sin, positions, 16, pool, out_loc, kv_out)
        pools.append(pool.clone() if not pools else pool)
        outs.append(kv_out)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    written = out_loc[out_loc >= 0].long()
    torch.testing.assert_close(pools[1][written].float(), pools[0][written].float(),
                               rtol=1e-2 if pool_dtype == torch.bfloat16 else 1e-5, atol=1e-5)


def test_triton_store_without_kv_out_leaves_unwritten_rows(device):
    require_triton()
    from dsv4_kernels import cache_write

    kv, weight, cos, sin, positions, out_loc = _cache_write_case(device, T=4, S=6)
    out_loc = torch.tensor([-1, 5, -1, 0], dtype=torch.int32, device=device)
    pool = torch.randn(6, 64, device=device)
    before = pool.clone()
    cache_write.rmsnorm_rope_store(kv, weight, 1e-6, cos, sin, positions, 16, pool, out_loc)
    expected = reference.apply_rope(reference.rms_norm(kv, weight, 1e-6), cos, sin, positions, 16)
    torch.testing.assert_close(pool[[5, 0]], expected[[1, 3]], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[1:5], before[1:5], rtol=0, atol=0)


@pytest.mark.parametrize("num_heads", [1, 3])
@pytest.mark.parametrize("one_table", [False, True], ids=["cos-sin", "cos_sin-pairs"])
def test_triton_q_rms_rope_and_inverse_rope_match_reference(device, num_heads, one_table):
    require_triton()
    from dsv4_kernels import cache_write

    T, D, rope_dim = 7, 64, 16
    q = torch.randn(T, num_heads, D, device=device) * 2
    cos, sin = rope_tables(100, rope_dim, device=device)
    if one_table:  # views into one [max_pos, rope_dim/2, 2] table
        cos_sin = torch.stack([cos, sin], dim=-1)
        cos, sin = cos_sin[..., 0], cos_sin[..., 1]
    positions = torch.randint(0, 100, (T,), device=device, dtype=torch.int32)
    expected = reference.q_rms_rope(q.clone(), cos, sin, positions, rope_dim, 1e-6)
    got = q.clone()
    assert cache_write.q_rms_rope(got, cos, sin, positions, rope_dim, 1e-6) is got
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # The inverse rotation undoes RoPE and leaves the nope dims alone.
    cache_write.inverse_rope_(got, cos, sin, positions, rope_dim)
    torch.testing.assert_close(got, reference.rms_norm(q, None, 1e-6), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("views", [False, True], ids=["contiguous", "stacked-views"])
@pytest.mark.parametrize("pool_kind", ["float32", "bfloat16", "nope_fp8", "fp8_rows"])
def test_triton_q_and_kv_in_one_launch_equal_their_own_launches(device, pool_kind, views):
    """q_kv_norm_rope_store writes exactly what q_rms_rope and rmsnorm_rope_store write, q in
    place and the kv rows into every pool format, padding tokens (-1) skipped. stacked-views:
    q and kv as the model holds them, column ranges of stacked linears' outputs (Fp8RowStack)."""
    require_triton()
    from dsv4_kernels import cache_write
    from dsv4_kernels.kv_fp8 import FP8KVLayout

    T, H, D, rope_dim, S = 6, 3, 128, 64, 10
    q = torch.randn(T, H, D, device=device) * 2
    kv = torch.randn(T, D, device=device) * 3 + 1
    if views:
        kv = torch.cat([torch.randn(T, 24, device=device), kv], 1)[:, 24:]

    def copy_of_q():  # written in place: each run gets its own, strided as the model's when views
        if not views:
            return q.clone()
        out = torch.cat([q.flatten(1), torch.randn(T, 40, device=device)], 1)[:, :H * D].unflatten(-1, (H, D))
        assert out.stride(0) == H * D + 40 and kv.stride(0) == D + 24
        return out
    weight = torch.rand(D, device=device) + 0.5
    cos, sin = rope_tables(300, rope_dim, device=device)
    positions = torch.randint(0, 300, (T,), device=device)
    out_loc = torch.randperm(S, device=device)[:T].to(torch.int32)
    out_loc[2] = -1

    def pool():
        if pool_kind == "fp8_rows":
            return torch.zeros(S, FP8KVLayout(D, rope_dim, torch.float32).row_bytes, dtype=torch.uint8, device=device)
        return torch.full((S, D), 7.0, device=device, dtype=torch.bfloat16 if pool_kind == "bfloat16" else torch.float32)

    nope_fp8 = pool_kind == "nope_fp8"
    q_two, pool_two = copy_of_q(), pool()
    cache_write.q_rms_rope(q_two, cos, sin, positions, rope_dim, 1e-6)
    cache_write.rmsnorm_rope_store(kv, weight, 1e-6, cos, sin, positions, rope_dim, pool_two, out_loc,
                                   nope_fp8=nope_fp8)
    q_one, pool_one = copy_of_q(), pool()
    assert cache_write.q_kv_norm_rope_store(q_one, kv, weight, 1e-6, cos, sin, positions, rope_dim, pool_one,
                                            out_loc, nope_fp8=nope_fp8) is q_one
    assert torch.equal(q_one, q_two)
    assert torch.equal(pool_one, pool_two)
    assert not torch.equal(q_one, q)  # it did write
    if pool_kind != "fp8_rows":  # rows no real token maps to (the padding token's included) stay as they were
        untouched = [r for r in range(S) if r not in out_loc.tolist()]
        assert len(untouched) == S - T + 1 and (pool_one[untouched] == 7.0).all()
    q_ref, pool_ref = copy_of_q(), pool()
    reference.q_kv_norm_rope_store(q_ref, kv, weight, 1e-6, cos, sin, positions, rope_dim, pool_ref, out_loc,
                                   nope_fp8=nope_fp8)
    torch.testing.assert_close(q_one, q_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_gpu_real_shapes_match_reference():
    T, H, D, rope_dim = 1000, 64, 512, 64
    cos, sin = rope_tables(8192, rope_dim, theta=160000.0, device="cuda")
    positions = torch.randint(0, 8192, (T,), device="cuda")
    kv = torch.randn(T, D, device="cuda").bfloat16()
    weight = torch.rand(D, device="cuda") + 0.5
    out_loc = torch.randperm(4096, device="cuda")[:T].int()
    out_loc[::7] = -1
    pool = torch.zeros(4096, D, device="cuda", dtype=torch.bfloat16)
    kv_out = torch.empty(T, D, device="cuda", dtype=torch.bfloat16)
    ops.rmsnorm_rope_store(kv, weight, 1e-6, cos, sin, positions, rope_dim, pool, out_loc, kv_out)
    expected = reference.apply_rope(reference.rms_norm(kv, weight, 1e-6), cos, sin, positions, rope_dim)
    torch.testing.assert_close(kv_out.float(), expected, rtol=1e-2, atol=1e-2)
    keep = out_loc >= 0
    torch.testing.assert_close(pool[out_loc[keep].long()], kv_out[keep], rtol=0, atol=0)

    q = torch.randn(T, H, D, device="cuda").bfloat16()
    expected_q = reference.apply_rope(reference.rms_norm(q, None, 1e-6), cos, sin, positions, rope_dim)
    ops.q_rms_rope(q, cos, sin, positions, rope_dim, 1e-6)
    torch.testing.assert_close(q.float(), expected_q, rtol=1e-2, atol=1e-2)
    o = q.clone()
    ops.inverse_rope_(o, cos, sin, positions, rope_dim)
    torch.testing.assert_close(o.float(), reference.apply_rope(q, cos, sin, positions, rope_dim,
                                                               inverse=True), rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64])
def test_gpu_q_and_kv_in_one_launch_at_flash_shapes(T):
    """Flash's attention at decode (64 heads of 512, rope 64, FP8 rows of 584 bytes): the one
    launch writes q and the pool rows bit for bit as the two launches do."""
    from dsv4_kernels import cache_write
    from dsv4_kernels.kv_fp8 import FP8KVLayout

    H, D, rope_dim = 64, 512, 64
    cos, sin = rope_tables(8192, rope_dim, theta=160000.0, device="cuda")
    positions = torch.randint(0, 8192, (T,), device="cuda")
    q = torch.randn(T, H, D, device="cuda").bfloat16()
    kv = torch.randn(T, D, device="cuda").bfloat16()
    weight = torch.rand(D, device="cuda") + 0.5
    out_loc = torch.randperm(256, device="cuda")[:T].int()
    pools = [torch.zeros(256, FP8KVLayout(D, rope_dim).row_bytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
    q_two, q_one = q.clone(), q.clone()
    cache_write.q_rms_rope(q_two, cos, sin, positions, rope_dim, 1e-6)
    cache_write.rmsnorm_rope_store(kv, weight, 1e-6, cos, sin, positions, rope_dim, pools[0], out_loc)
    cache_write.q_kv_norm_rope_store(q_one, kv, weight, 1e-6, cos, sin, positions, rope_dim, pools[1], out_loc)
    assert torch.equal(q_one, q_two) and torch.equal(pools[1], pools[0])
