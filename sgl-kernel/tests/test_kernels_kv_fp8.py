"""FP8 KV cache: the row layout, its torch pack/unpack, and the Triton write (norm + RoPE +
quantize) and read (sparse attention dequantizing on load) against them.

Exactness: the quantization is deterministic, so the Triton write must produce the very bytes
that kv_fp8.pack produces from the same fp32 values (its own kv_out). The fp32 values
themselves may differ from the torch reference's by an ulp (rsqrt, summation order), which
can move a rounding decision; those comparisons use a tolerance of one e4m3 step.
"""

import pytest
import torch

from dsv4_kernels import ops, reference
from dsv4_kernels.kv_fp8 import FP8KVLayout, kv_row_bytes, round_nope_fp8
from dsv4_kernels.quant_reference import fp8_round_blocks
from kernel_test_utils import random_index_lists, require_triton, rope_tables


# ---- layout and torch ground truth ---------------------------------------------------------

def test_release_shape_is_584_bytes_per_entry():
    layout = FP8KVLayout(512, 64)
    # 448 e4m3 + 64 bf16 rope + 7 scales + 1 pad: the release kernels' size
    assert (layout.nope_dim, layout.num_scales, layout.rope_offset, layout.scale_offset) == (448, 7, 448, 576)
    assert layout.row_bytes == 584
    assert FP8KVLayout(512, 64, torch.float32).row_bytes == 448 + 256 + 7 + 1
    assert kv_row_bytes(512, 64, "fp8_e4m3", torch.bfloat16) == 584
    assert kv_row_bytes(512, 64, "auto", torch.bfloat16) == 1024
    assert kv_row_bytes(512, 64, "auto", torch.float32) == 2048


@pytest.mark.parametrize("head_dim,rope_dim", [(64, 16), (96, 64), (130, 64)])
def test_nope_dims_must_be_whole_64_blocks(head_dim, rope_dim):
    with pytest.raises(ValueError, match="multiple of 64"):
        FP8KVLayout(head_dim, rope_dim)


def test_pack_hand_computed_row():
    layout = FP8KVLayout(80, 16)  # one 64-dim nope block, rope 16 in bf16: 64 + 32 + 1 -> 104
    assert layout.row_bytes == 104
    x = torch.zeros(1, 80)
    x[0, 0], x[0, 1], x[0, 2] = 1.0, -2.0, 2.0 ** -20
    x[0, 64:] = torch.arange(16) * 0.5
    rows = layout.pack(x)
    # amax 2: scale = smallest 2^k >= 2/448 = 2^-7 (e8m0 byte 120); 1 / 2^-7 = 128 = 2^7 is
    # e4m3 (7+7) << 3 = 0x70; -256 = 2^8 is 0xF8 with the sign; 2^-13 is below half the
    # smallest e4m3 step (2^-9) and rounds to 0.
    assert rows[0, :4].tolist() == [0x70, 0xF8, 0x00, 0x00]
    assert layout.scales(rows).tolist() == [[120]]
    assert torch.equal(layout.rope(rows)[0].float(), x[0, 64:])
    assert rows[0, 97:].tolist() == [0] * 7  # padding
    back = layout.unpack(rows)
    assert back[0, :3].tolist() == [1.0, -2.0, 0.0] and torch.equal(back[0, 64:], x[0, 64:])


@pytest.mark.parametrize("rope_dtype", [torch.bfloat16, torch.float32])
def test_unpack_of_pack_is_the_release_rounding(rope_dtype):
    layout = FP8KVLayout(192, 64, rope_dtype)
    x = torch.randn(33, 192) * torch.logspace(-3, 3, 33)[:, None]  # scales far apart per row
    x[5, :64] = 0.0  # an all-zero block: finite, zeros back
    back = layout.unpack(layout.pack(x))
    torch.testing.assert_close(back[:, :128], fp8_round_blocks(x[:, :128], 64), rtol=0, atol=0)
    torch.testing.assert_close(back[:, 128:], x[:, 128:].to(rope_dtype).float(), rtol=0, atol=0)
    assert torch.equal(round_nope_fp8(x, 64), torch.cat([back[:, :128], x[:, 128:]], 1))
    assert layout.unpack(layout.pack(x)[None]).shape == (1, 33, 192)  # leading dims kept


def test_views_share_the_rows_storage():
    layout = FP8KVLayout(128, 64)
    rows = torch.zeros(3, layout.row_bytes, dtype=torch.uint8)
    layout.rope(rows)[1, 0] = 1.0
    layout.scales(rows)[2, 0] = 127
    layout.nope(rows)[0, 5] = 2.0
    assert layout.unpack(rows)[1, 64] == 1.0
    assert rows[2, layout.scale_offset] == 127 and rows[0, 5] == 0x40  # e4m3 2.0 = 0x40


def test_reference_attention_over_fp8_rows_equals_attention_over_their_values():
    layout = FP8KVLayout(128, 64)
    kv_a, kv_b = layout.pack(torch.randn(40, 128)), layout.pack(torch.randn(30, 128))
    q = torch.randn(5, 3, 128)
    idx_a, len_a = random_index_lists(5, 16, 40, [0, 3, 16, 9, 1])
    idx_b, len_b = random_index_lists(5, 8, 30, [8, 0, 2, 5, 7])
    sink = torch.randn(3)
    got = reference.sparse_attn_with_sink(q, kv_a, idx_a, len_a, kv_b, idx_b, len_b, sink, 0.1,
                                          torch.empty_like(q), kv_layout=layout)
    want = reference.sparse_attn_with_sink(q, layout.unpack(kv_a), idx_a, len_a, layout.unpack(kv_b),
                                           idx_b, len_b, sink, 0.1, torch.empty_like(q))
    assert torch.equal(got, want)


def test_uint8_rows_without_a_layout_are_refused():
    kv = FP8KVLayout(128, 64).pack(torch.randn(4, 128))
    idx, lens = random_index_lists(1, 2, 4, [2])
    with pytest.raises(ValueError, match="kv_layout"):
        reference.sparse_attn_with_sink(torch.randn(1, 1, 128), kv, idx, lens, None, None, None,
                                        torch.zeros(1), 1.0, torch.empty(1, 1, 128))


def test_reference_write_rounds_a_float_pool_only_when_asked():
    cos, sin = rope_tables(16, 64)
    kv, w = torch.randn(3, 128), torch.rand(128) + 0.5
    pos, loc = torch.tensor([1, 2, 3]), torch.tensor([0, 2, -1], dtype=torch.int32)
    plain, rounded = torch.zeros(4, 128), torch.zeros(4, 128)
    y = torch.empty(3, 128)
    reference.rmsnorm_rope_store(kv, w, 1e-6, cos, sin, pos, 64, plain, loc, y)
    reference.rmsnorm_rope_store(kv, w, 1e-6, cos, sin, pos, 64, rounded, loc, nope_fp8=True)
    assert torch.equal(plain[[0, 2]], y[:2])
    assert torch.equal(rounded[[0, 2]], round_nope_fp8(y[:2], 64))
    assert not torch.equal(rounded[0, :64], plain[0, :64]) and torch.equal(rounded[0, 64:], plain[0, 64:])
    assert rounded[[1, 3]].abs().max() == 0  # padding token wrote nothing


# ---- Triton write ----------------------------------------------------------------------------

def _special_values():
    """Every e4m3 value, the midpoints between neighbours (ties), a hair either side, values
    below the smallest subnormal, saturation, and both zeros."""
    codes = torch.arange(0, 127, dtype=torch.uint8)  # 0x7F is NaN
    pos = codes.view(torch.float8_e4m3fn).float()
    mids = (pos[1:] + pos[:-1]) / 2
    v = torch.cat([pos, mids, mids.nextafter(torch.tensor(1e9)), mids.nextafter(torch.tensor(-1.0)),
                   torch.tensor([2.0 ** -10, 2.0 ** -11, 3 * 2.0 ** -11, 1e-30, 447.0, 449.0, 464.0,
                                 500.0, 1e6, 0.0])])
    return torch.cat([v, -v])


def test_triton_e4m3_encoder_matches_torch_cast(device):
    require_triton()
    from dsv4_kernels.cache_write import encode_e4m3

    x = _special_values().to(device)
    out = encode_e4m3(x)
    want = x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    bad = (out != want).nonzero().flatten()
    assert bad.numel() == 0, [(x[i].item(), out[i].item(), want[i].item()) for i in bad[:5]]


def _write_case(device, T=9, D=192, rope_dim=64, S=20, max_pos=300):
    kv = torch.randn(T, D, device=device) * 3 + 1
    kv[2, :64] *= 1e-6  # a tiny block: a tiny scale, still exact
    weight = torch.rand(D, device=device) + 0.5
    cos, sin = rope_tables(max_pos, rope_dim, device=device)
    positions = torch.randint(0, max_pos, (T,), device=device)
    out_loc = torch.randperm(S, device=device)[:T].to(torch.int32)
    out_loc[[1, T - 1]] = -1
    return kv, weight, cos, sin, positions, out_loc


@pytest.mark.parametrize("rope_dtype", [torch.bfloat16, torch.float32])
def test_triton_fp8_row_write_is_bit_exact(device, rope_dtype):
    require_triton()
    from dsv4_kernels import cache_write

    layout = FP8KVLayout(192, 64, rope_dtype)
    kv, weight, cos, sin, positions, out_loc = _write_case(device)
    pool = torch.randint(0, 255, (20, layout.row_bytes), dtype=torch.uint8, device=device)
    before = pool.clone()
    y = torch.empty(kv.shape, device=device)  # fp32: exactly the values the kernel quantized
    cache_write.rmsnorm_rope_store(kv, weight, 1e-6, cos, sin, positions, 64, pool, out_loc, y)
    live = out_loc >= 0
    rows = pool[out_loc[live].long()]
    want = layout.pack(y[live])
    values = slice(0, layout.rope_offset)
    scales = slice(layout.scale_offset, layout.scale_offset + layout.num_scales)
    assert torch.equal(rows[:, values], want[:, values])
    assert torch.equal(rows[:, scales], want[:, scales])
    # rope dims: a cast of the same fp32 value (the interpreter's bf16 cast may not round to
    # nearest even, so one bf16 step of slack there)
    torch.testing.assert_close(layout.rope(rows).float(), y[live, 128:].to(rope_dtype).float(),
                               rtol=2 ** -7, atol=0)
    untouched = torch.ones(20, dtype=torch.bool, device=device)
    untouched[out_loc[live].long()] = False
    assert torch.equal(pool[untouched], before[untouched])
    # and against the torch reference's own values: one e4m3 step at most
    ref_y = reference.apply_rope(reference.rms_norm(kv, weight, 1e-6), cos, sin, positions, 64)
    torch.testing.assert_close(layout.unpack(rows), layout.unpack(layout.pack(ref_y[live])),
                               rtol=2 ** -3, atol=1e-6)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_triton_rounding_write_into_a_float_pool(device, pool_dtype):
    require_triton()
    from dsv4_kernels import cache_write

    kv, weight, cos, sin, positions, out_loc = _write_case(device)
    pool = torch.zeros(20, 192, dtype=pool_dtype, device=device)
    y = torch.empty(kv.shape, device=device)
    cache_write.rmsnorm_rope_store(kv, weight, 1e-6, cos, sin, positions, 64, pool, out_loc, y,
                                   nope_fp8=True)
    live = out_loc >= 0
    got = pool[out_loc[live].long()].float()
    assert torch.equal(got[:, :128], fp8_round_blocks(y[live, :128], 64))  # exact in bf16 too
    torch.testing.assert_close(got[:, 128:], y[live, 128:].to(pool_dtype).float(), rtol=2 ** -7, atol=0)


def test_ops_write_then_read_round_trips_through_the_pool(device):
    """ops entry points (Triton on CUDA, reference on CPU): what attention reads back is the
    pool's dequantized rows."""
    layout = FP8KVLayout(128, 64)
    cos, sin = rope_tables(64, 64, device=device)
    kv = torch.randn(6, 128, device=device)
    pool = torch.zeros(8, layout.row_bytes, dtype=torch.uint8, device=device)
    loc = torch.tensor([3, 1, 4, 0, 5, 7], dtype=torch.int32, device=device)
    ops.rmsnorm_rope_store(kv, torch.ones(128, device=device), 1e-6, cos, sin,
                           torch.arange(6, device=device), 64, pool, loc)
    # One head whose q picks out dim 0: a single listed row gives back that row (sink -inf).
    q = torch.zeros(1, 1, 128, device=device)
    idx = torch.tensor([[4]], dtype=torch.int32, device=device)
    out = torch.empty(1, 1, 128, device=device)
    ops.sparse_attn_with_sink(q, pool, idx, torch.tensor([1], dtype=torch.int32, device=device), None,
                              None, None, torch.full((1,), -1e30, device=device), 1.0, out, kv_layout=layout)
    torch.testing.assert_close(out[0, 0], layout.unpack(pool[4:5])[0], rtol=1e-6, atol=1e-6)


# ---- Triton read -----------------------------------------------------------------------------

LEN_A = [0, 1, 31, 32, 33, 40, 40, 0]
LEN_B = [70, 64, 0, 33, 1, 0, 69, 0]


@pytest.mark.parametrize("num_splits,keys_as_m", [(1, False), (2, False), (1, True)])
@pytest.mark.parametrize("rope_dtype", [torch.bfloat16, torch.float32])
def test_triton_attention_over_fp8_rows_matches_reference(device, num_splits, keys_as_m, rope_dtype):
    require_triton()
    from dsv4_kernels.sparse_attention import SparseAttnConfig, sparse_attn_with_sink

    layout = FP8KVLayout(128, 64, rope_dtype)
    kv_a = layout.pack(torch.randn(97, 128, device=device) * 2)
    kv_b = layout.pack(torch.randn(61, 128, device=device))
    q = torch.randn(8, 4, 128, device=device)
    idx_a, len_a = random_index_lists(8, 40, 97, LEN_A, device=device)
    idx_b, len_b = random_index_lists(8, 70, 61, LEN_B, device=device)
    sink = torch.randn(4, device=device)
    want = reference.sparse_attn_with_sink(q, kv_a, idx_a, len_a, kv_b, idx_b, len_b, sink, 128 ** -0.5,
                                           torch.empty_like(q), kv_layout=layout)
    out = torch.full_like(q, float("nan"))
    sparse_attn_with_sink(q, kv_a, idx_a, len_a, kv_b, idx_b, len_b, sink, 128 ** -0.5, out,
                          SparseAttnConfig(num_splits=num_splits, keys_as_m=keys_as_m), kv_layout=layout)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert out[7].abs().max() == 0  # nothing valid: zeros


# ---- compiled, at the real head_dim ------------------------------------------------------------

@pytest.mark.gpu
def test_compiled_kernels_at_head_dim_512():
    """bf16 model shapes of DeepSeek-V4 (D 512 = 448 nope + 64 rope, 584-byte rows): the
    compiled write gives pack()'s bytes, and the compiled read matches the reference."""
    from dsv4_kernels import cache_write
    from dsv4_kernels.sparse_attention import sparse_attn_with_sink

    dev = "cuda"
    layout = FP8KVLayout(512, 64)
    T, S = 300, 4096
    kv = (torch.randn(T, 512, device=dev) * 2).to(torch.bfloat16)
    cos, sin = rope_tables(4096, 64, device=dev)
    pool = torch.zeros(S, 584, dtype=torch.uint8, device=dev)
    loc = torch.randperm(S, device=dev)[:T].to(torch.int32)
    y = torch.empty(T, 512, device=dev)
    cache_write.rmsnorm_rope_store(kv, torch.rand(512, device=dev) + 0.5, 1e-6, cos, sin,
                                   torch.randint(0, 4096, (T,), device=dev), 64, pool, loc, y)
    rows, want = pool[loc.long()], layout.pack(y)
    assert torch.equal(rows[:, :448], want[:, :448]) and torch.equal(rows[:, 576:583], want[:, 576:583])
    assert torch.equal(rows[:, 448:576], want[:, 448:576])  # compiled bf16 cast: nearest even

    H = 64
    q = torch.randn(T, H, 512, device=dev, dtype=torch.bfloat16)
    idx_a, len_a = random_index_lists(T, 128, S, torch.randint(0, 129, (T,)).tolist(), device=dev)
    idx_b, len_b = random_index_lists(T, 512, S, torch.randint(0, 513, (T,)).tolist(), device=dev)
    sink = torch.randn(H, device=dev)
    ref = reference.sparse_attn_with_sink(q, pool, idx_a, len_a, pool, idx_b, len_b, sink, 512 ** -0.5,
                                          torch.empty(T, H, 512, device=dev), kv_layout=layout)
    for T_run in (1, 8, T):  # split-KV, head-block and keys-as-M configurations
        out = torch.empty(T_run, H, 512, device=dev, dtype=torch.bfloat16)
        sparse_attn_with_sink(q[:T_run], pool, idx_a[:T_run], len_a[:T_run], pool, idx_b[:T_run],
                              len_b[:T_run], sink, 512 ** -0.5, out, kv_layout=layout)
        torch.testing.assert_close(out.float(), ref[:T_run], rtol=2e-2, atol=2e-2)
