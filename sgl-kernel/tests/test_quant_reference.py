"""quant_reference: every release-format formula against an independent check (brute force over
the format's values, float64 arithmetic, explicit matrices)."""

import math

import pytest
import torch

from dsv4_kernels import ops
from dsv4_kernels import quant_reference as Q

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _e4m3_table():
    """All finite e4m3fn values by code (0..126 positive; 127 is NaN), from the bit layout."""
    vals = []
    for code in range(127):
        e, m = code >> 3, code & 7
        vals.append(m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return vals


def _nearest_even(v: float, table):
    """The table value nearest to |v| (ties to the even code), with v's sign."""
    a = abs(v)
    best = min(range(len(table)), key=lambda i: (abs(table[i] - a), i % 2))
    return math.copysign(table[best], v) if table[best] else 0.0


def _pow2_expected(amax: float, qmax: float) -> float:
    s = torch.tensor(max(amax, Q.AMAX_FLOOR), dtype=torch.float32) * torch.tensor(
        1.0 / qmax, dtype=torch.float32)
    s = float(s)
    p = 2.0 ** math.ceil(math.log2(s))
    return p if p / 2 < s else p / 2  # log2 of an exact power of two may land a hair above


@pytest.mark.parametrize("qmax", [Q.E4M3_MAX, Q.E2M1_MAX])
def test_pow2_scale_is_the_smallest_power_of_two_covering_amax(qmax):
    amax = [qmax * 2.0 ** k for k in range(-8, 9)]  # exact powers of two stay
    amax += [qmax * 2.0 ** k * (1 + 2 ** -20) for k in range(-8, 9)]  # just above: doubles
    amax += [0.37, 1.0, 5.99, 7.0, 300.0, 449.0, 1e6]
    got = Q.pow2_scale(torch.tensor(amax), qmax)
    assert got.dtype == torch.float32
    assert got.tolist() == [_pow2_expected(a, qmax) for a in amax]
    assert got[:17].tolist() == [2.0 ** k for k in range(-8, 9)]
    assert got[17:34].tolist() == [2.0 ** (k + 1) for k in range(-8, 9)]


def test_zero_and_tiny_blocks_get_the_floor_scale_and_stay_finite():
    s = Q.pow2_scale(torch.tensor([0.0, 1e-30, Q.AMAX_FLOOR]), Q.E4M3_MAX)
    assert s.tolist() == [2.0 ** -22] * 3  # 1e-4 / 448 = 2.2e-7 -> 2^-22
    x = torch.zeros(2, 128)
    q, scale = Q.quantize_fp8_blocks(x)
    assert q.float().eq(0).all() and scale.eq(2.0 ** -22).all()
    assert Q.fp8_round_blocks(x).eq(0).all() and Q.fp4_round_blocks(x).eq(0).all()


def test_quantize_fp8_blocks_rounds_to_nearest_even_and_saturates():
    table = _e4m3_table()
    # One block of 128 with amax 448 (scale 1): values spread over the whole range, including
    # the exact midpoints between neighbours (ties) and subnormals.
    mids = [(table[i] + table[i + 1]) / 2 for i in range(0, 126, 3)]
    vals = [448.0, -447.0, 0.0] + mids + [-v for v in mids[:40]]
    vals += [0.001 * i for i in range(128 - len(vals))]
    x = torch.tensor(vals)[None]
    q, scale = Q.quantize_fp8_blocks(x)
    assert scale.tolist() == [[1.0]] and q.dtype == torch.float8_e4m3fn
    assert q.float()[0].tolist() == [_nearest_even(v, table) for v in vals]
    # A second block scaled by 2^-10: same codes, scale 2^-10.
    q2, s2 = Q.quantize_fp8_blocks(torch.cat([x, x * 2.0 ** -10], dim=1))
    assert s2.tolist() == [[1.0, 2.0 ** -10]] and torch.equal(q2[:, 128:].float(), q.float())


def test_fp8_round_keeps_dtype_and_is_exact_dequantization():
    x = torch.randn(3, 256) * 10
    q, s = Q.quantize_fp8_blocks(x)
    r = Q.fp8_round_blocks(x)
    assert torch.equal(r, (q.float().view(3, 2, 128) * s[..., None]).view(3, 256))
    rb = Q.fp8_round_blocks(x.bfloat16())
    assert rb.dtype == torch.bfloat16
    assert torch.equal(rb.float(), Q.fp8_round_blocks(x.bfloat16().float()))


def test_block_size_must_divide_the_last_dim():
    with pytest.raises(ValueError, match="not a multiple of the block size 128"):
        Q.quantize_fp8_blocks(torch.zeros(2, 100))
    with pytest.raises(ValueError, match="block size 32"):
        Q.fp4_round_blocks(torch.zeros(48))


def test_fp4_round_ties_to_the_even_code():
    # amax 6 -> scale 1: the midpoints of neighbouring e2m1 values and their expected picks.
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]  # codes 0, 2, 2, 4, 4, 6, 6
    x = torch.tensor(ties + [-v for v in ties] + [6.0] + [0.1] * (32 - 15))
    r = Q.fp4_round_blocks(x)
    assert r[:7].tolist() == want and r[7:14].tolist() == [-v for v in want]
    y = torch.randn(4, 64) * 3
    scale = Q.pow2_scale(y.view(4, 2, 32).abs().amax(-1), Q.E2M1_MAX)
    ry = Q.fp4_round_blocks(y).view(4, 2, 32)
    for i in range(4):
        for b in range(2):
            s = float(scale[i, b])
            want = [_nearest_even(v / s, E2M1) * s for v in y.view(4, 2, 32)[i, b].tolist()]
            assert ry[i, b].tolist() == want


def test_fp4_pack_unpack_round_trip_over_all_codes():
    codes = torch.arange(16).repeat(2)  # every code in the low and the high nibble
    packed = Q.pack_fp4(codes)
    assert packed.dtype == torch.int8 and packed.shape == (16,)
    assert packed.view(torch.uint8)[0].item() == 0x10 and packed.view(torch.uint8)[7].item() == 0xFE
    assert Q.unpack_fp4(packed).tolist() == E2M1 + [-v for v in E2M1] + E2M1 + [-v for v in E2M1]
    assert torch.equal(Q.unpack_fp4(packed.view(torch.uint8)), Q.unpack_fp4(packed))
    with pytest.raises(ValueError, match="odd"):
        Q.pack_fp4(torch.zeros(3, dtype=torch.long))
    with pytest.raises(TypeError, match="int8/uint8"):
        Q.unpack_fp4(torch.zeros(4))


def test_quantize_fp4_is_what_dequantize_fp4_and_fp4_round_agree_on():
    x = torch.randn(3, 5, 96) * torch.logspace(-3, 3, 96)
    packed, scale = Q.quantize_fp4(x)
    assert packed.shape == (3, 5, 48) and scale.shape == (3, 5, 3) and scale.dtype == torch.uint8
    assert torch.equal(Q.dequantize_fp4(packed, scale), Q.fp4_round_blocks(x))
    with pytest.raises(ValueError, match="scale shape"):
        Q.dequantize_fp4(packed, scale[..., :2])


def test_e8m0_conversions_are_raw_exponent_bits():
    k = torch.arange(-126, 128)
    bytes_ = Q.fp32_to_e8m0(torch.tensor([2.0 ** int(i) for i in k]))
    assert bytes_.dtype == torch.uint8 and bytes_.tolist() == (k + 127).tolist()
    assert Q.e8m0_to_fp32(bytes_).tolist() == [2.0 ** int(i) for i in k]
    assert Q.e8m0_to_fp32(torch.tensor([0], dtype=torch.uint8)).item() == 2.0 ** -127
    if hasattr(torch, "float8_e8m0fnu"):  # the checkpoint dtype reads as the same bytes
        assert Q.e8m0_to_fp32(bytes_.view(torch.float8_e8m0fnu)).tolist() == \
            [2.0 ** int(i) for i in k]
    with pytest.raises(ValueError, match="powers of two"):
        Q.fp32_to_e8m0(torch.tensor([1.0, 3.0]))
    with pytest.raises(ValueError, match="powers of two"):
        Q.fp32_to_e8m0(torch.tensor([0.0]))


def test_hadamard_is_sylvester_scaled_and_orthogonal():
    h = torch.ones(1, 1, dtype=torch.float64)
    for _ in range(4):
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    x = torch.randn(3, 16, dtype=torch.float64)
    assert torch.allclose(Q.hadamard_rotate(x), x @ h.t() / 4, atol=1e-6)  # fp32 inside
    eye = torch.eye(128)
    m = Q.hadamard_rotate(eye)
    assert torch.allclose(m @ m.t(), eye, atol=1e-6)
    y = torch.randn(5, 128)
    assert torch.allclose(Q.hadamard_rotate(Q.hadamard_rotate(y)), y, atol=1e-5)
    with pytest.raises(ValueError, match="power of two"):
        Q.hadamard_rotate(torch.zeros(2, 96))


def test_fp8_weight_quantize_and_dequantize_per_128_block():
    w = torch.randn(300, 200) * torch.linspace(0.01, 5, 200)
    q, s = Q.quantize_fp8_weight(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (300, 200) and s.shape == (3, 2)
    deq = Q.dequantize_fp8_block(q, s)
    for bi in range(3):
        for bk in range(2):
            blk = w[bi * 128:(bi + 1) * 128, bk * 128:(bk + 1) * 128]
            sc = _pow2_expected(blk.abs().max().item(), Q.E4M3_MAX)
            assert s[bi, bk].item() == sc
            assert torch.equal(deq[bi * 128:(bi + 1) * 128, bk * 128:(bk + 1) * 128],
                               (blk / sc).to(torch.float8_e4m3fn).float() * sc)
    with pytest.raises(ValueError, match=r"fp32 \(3, 2\)"):
        Q.dequantize_fp8_block(q, s[:2])


@pytest.mark.parametrize("act_quant", [True, False])
def test_fp8_block_linear_matches_float64_on_dequantized_operands(act_quant):
    w = torch.randn(1100, 256)  # N spans several dequantization slabs and a ragged block
    q, s = Q.quantize_fp8_weight(w)
    x = torch.randn(2, 3, 256)
    y = Q.fp8_block_linear_ref(x, q, s, act_quant)
    xa = Q.fp8_round_blocks(x) if act_quant else x
    want = xa.double() @ Q.dequantize_fp8_block(q, s).double().t()
    assert y.shape == (2, 3, 1100) and y.dtype == x.dtype
    # Exact products, fp32 sums of 256 terms: a few fp32 ulps of the magnitudes summed.
    assert torch.allclose(y.double(), want, rtol=1e-5, atol=1e-4)
    assert torch.equal(ops.fp8_block_linear(x, q, s, act_quant), y)  # CPU: the reference
    yb = Q.fp8_block_linear_ref(x.bfloat16(), q, s, act_quant)
    assert yb.dtype == torch.bfloat16


def test_fp8_block_linear_act_quant_changes_the_result_and_refuses_ragged_k():
    w = torch.randn(128, 256)
    q, s = Q.quantize_fp8_weight(w)
    x = torch.randn(4, 256)
    assert not torch.equal(Q.fp8_block_linear_ref(x, q, s, True),
                           Q.fp8_block_linear_ref(x, q, s, False))
    q2, s2 = Q.quantize_fp8_weight(torch.randn(64, 200))
    with pytest.raises(ValueError, match="not a multiple of the block size 128"):
        Q.fp8_block_linear_ref(torch.randn(1, 200), q2, s2, True)
    with pytest.raises(ValueError, match="K=100"):
        Q.fp8_block_linear_ref(torch.randn(1, 100), q2, s2, False)


def _fp4_experts(E, out_dim, in_dim, gain):
    return Q.quantize_fp4(torch.randn(E, out_dim, in_dim) * gain)


def _moe_float64(x, w1, w3, w2, ids, weights, limit, act_quant):
    """Per assignment, in float64, from the dequantized experts."""
    xa = Q.fp8_round_blocks(x) if act_quant else x
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if not 0 <= e < w1.shape[0]:
                continue
            g = xa[t].double() @ w1[e].double().t()
            u = xa[t].double() @ w3[e].double().t()
            g, u = g.clamp(max=limit), u.clamp(-limit, limit)
            h = (torch.nn.functional.silu(g) * u * float(weights[t, k])).float()
            if act_quant:
                h = Q.fp8_round_blocks(h)
            out[t] += h.double() @ w2[e].double().t()
    return out


@pytest.mark.parametrize("act_quant", [False, True])
def test_fp4_moe_ref_matches_per_assignment_float64(act_quant):
    E, d, inter, T = 3, 128, 128, 4
    w1, s1 = _fp4_experts(E, inter, d, 0.1)
    w3, s3 = _fp4_experts(E, inter, d, 0.1)
    w2, s2 = _fp4_experts(E, d, inter, 0.1)
    x = torch.randn(T, d)
    ids = torch.tensor([[0, 2], [1, -1], [5, 2], [-1, -1]], dtype=torch.int32)  # 5: other shard
    weights = torch.rand(T, 2)
    out = Q.fp4_moe_ref(x, w1, s1, w3, s3, w2, s2, ids, weights, 2.0, act_quant)
    deq = [Q.dequantize_fp4(w, s) for w, s in ((w1, s1), (w3, s3), (w2, s2))]
    want = _moe_float64(x, *deq, ids, weights, 2.0, act_quant)
    assert out.dtype == torch.float32 and out[3].eq(0).all()
    assert torch.allclose(out.double(), want, rtol=1e-5, atol=1e-5)
    buf = torch.empty(T, d)
    assert ops.fp4_fused_moe(x, w1, s1, w3, s3, w2, s2, ids, weights, 2.0, buf, act_quant) is buf
    assert torch.equal(buf, out)


def test_fp4_moe_ref_names_a_bad_scale():
    w1, s1 = _fp4_experts(2, 128, 128, 0.1)
    with pytest.raises(ValueError, match="w3_scale"):
        Q.fp4_moe_ref(torch.randn(1, 128), w1, s1, w1, s1[:, :, :2], w1, s1,
                      torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 1), 0.0, False)
