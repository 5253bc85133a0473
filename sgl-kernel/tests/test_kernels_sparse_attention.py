"""sparse_attn_with_sink: one sink-softmax over the union of window and compressed entries."""

import math

import pytest
import torch

from dsv4_kernels import PageTableList, ops, reference
from kernel_test_utils import paged_page_table, random_index_lists, require_triton


def test_reference_matches_hand_computed_sink_softmax():
    # Scores ln2 (window entry) and ln3 (compressed entry), sink ln5: probabilities 2/10 and
    # 3/10, the sink's 5/10 goes nowhere.
    kv_a = torch.tensor([[1.0, 0.0], [9.0, 9.0]])
    kv_b = torch.tensor([[0.0, 1.0]])
    q = torch.tensor([[[math.log(2.0), math.log(3.0)]]])
    idx_a = torch.tensor([[0, -1, 1]], dtype=torch.int32)  # -1 padding, then a row past len
    idx_b = torch.tensor([[0]], dtype=torch.int32)
    out = torch.empty(1, 1, 2)
    reference.sparse_attn_with_sink(q, kv_a, idx_a, torch.tensor([2], dtype=torch.int32), kv_b,
                                    idx_b, torch.tensor([1], dtype=torch.int32),
                                    torch.tensor([math.log(5.0)]), 1.0, out)
    torch.testing.assert_close(out, torch.tensor([[[0.2, 0.3]]]))


def test_reference_counts_a_slot_listed_twice_twice():
    kv = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    q = torch.zeros(1, 1, 2)  # all scores 0: each listed entry weighs e^0, the sink e^0 too
    idx = torch.tensor([[0, 0, 1]], dtype=torch.int32)
    out = torch.empty(1, 1, 2)
    reference.sparse_attn_with_sink(q, kv, idx, torch.tensor([3], dtype=torch.int32), None, None,
                                    None, torch.zeros(1), 1.0, out)
    torch.testing.assert_close(out, torch.tensor([[[0.5, 0.25]]]))


def _random_case(device, dtype, T, H, D, Wa, Wb, len_a, len_b, Sa=97, Sb=61):
    q = torch.randn(T, H, D, device=device).to(dtype)
    kv_a = torch.randn(Sa, D, device=device).to(dtype)
    kv_b = torch.randn(Sb, D, device=device).to(dtype)
    idx_a, len_a = random_index_lists(T, Wa, Sa, len_a, device=device)
    idx_b, len_b = random_index_lists(T, Wb, Sb, len_b, device=device)
    sink = torch.randn(H, device=device)
    return q, kv_a, idx_a, len_a, kv_b, idx_b, len_b, sink


# Lengths at BLOCK_N (32) boundaries, empty lists, and one token with nothing valid at all.
LEN_A = [0, 1, 31, 32, 33, 40, 40, 0]
LEN_B = [70, 64, 0, 33, 1, 0, 69, 0]


@pytest.mark.parametrize("num_splits", [1, 2, 4])
@pytest.mark.parametrize("has_b", [True, False])
@pytest.mark.parametrize("num_heads", [4, 20])
@pytest.mark.parametrize("keys_as_m", [False, True])
def test_triton_matches_reference(device, num_splits, has_b, num_heads, keys_as_m):
    require_triton()
    from dsv4_kernels.sparse_attention import SparseAttnConfig, sparse_attn_with_sink

    q, kv_a, idx_a, len_a, kv_b, idx_b, len_b, sink = _random_case(
        device, torch.float32, len(LEN_A), num_heads, 64, 40, 70, LEN_A, LEN_B)
    idx_a[5, :40] = -1  # valid length but every entry is padding
    if not has_b:
        kv_b = idx_b = len_b = None
    scale = 64 ** -0.5
    expected = reference.sparse_attn_with_sink(q, kv_a, idx_a, len_a, kv_b, idx_b, len_b, sink,
                                               scale, torch.empty_like(q))
    out = torch.full_like(q, float("nan"))
    sparse_attn_with_sink(q, kv_a, idx_a, len_a, kv_b, idx_b, len_b, sink, scale, out,
                          SparseAttnConfig(num_splits=num_splits, keys_as_m=keys_as_m))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert out[7].abs().max() == 0  # no valid entry: zeros
    if not has_b:
        assert out[0].abs().max() == 0 and out[5].abs().max() == 0


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("rope_dim", [32, 96])
# (bf16 dots are not emulated faithfully by the interpreter: bf16 on a GPU only)
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)])
def test_output_rope_in_the_store_equals_a_separate_inverse_rope(device, num_splits, rope_dim, dtype):
    """out_rope undoes the RoPE in the attention's own stores (the merge's with split lists,
    in D chunks: 96 rope dims of 128 span two of them) with the values of the attention
    followed by inverse_rope_: bit for bit under the interpreter and in bf16 (the rotation's
    last fp32 bit, which the compiler's FMA contraction may place differently in the two
    kernels, is rounded away); fp32 on a GPU within that bit. The reference agrees."""
    require_triton()
    from dsv4_kernels.cache_write import inverse_rope_
    from dsv4_kernels.sparse_attention import SparseAttnConfig, sparse_attn_with_sink

    D = 128
    case = _random_case(device, dtype, len(LEN_A), 4, D, 40, 70, LEN_A, LEN_B)
    cos, sin = torch.randn(2, 50, rope_dim // 2, device=device).unbind(0)
    positions = torch.randint(0, 50, (len(LEN_A) + 3,), device=device, dtype=torch.int32)  # bucket-sized
    rope = (cos, sin, positions, rope_dim)
    config = SparseAttnConfig(num_splits=num_splits)
    plain = sparse_attn_with_sink(*case, D ** -0.5, torch.full_like(case[0], float("nan")), config)
    fused = sparse_attn_with_sink(*case, D ** -0.5, torch.full_like(case[0], float("nan")), config,
                                  out_rope=rope)
    separate = inverse_rope_(plain.clone(), cos, sin, positions, rope_dim)
    if dtype == torch.float32 and fused.is_cuda:
        torch.testing.assert_close(fused, separate, rtol=3e-7, atol=1e-7)
    else:
        assert torch.equal(fused, separate)
    assert not torch.equal(fused[:, :, D - rope_dim:], plain[:, :, D - rope_dim:])
    assert torch.equal(fused[:, :, :D - rope_dim], plain[:, :, :D - rope_dim])
    expected = reference.inverse_rope_(reference.sparse_attn_with_sink(*case, D ** -0.5, torch.empty_like(case[0])),
                                       cos, sin, positions[:len(LEN_A)], rope_dim)
    assert torch.equal(reference.sparse_attn_with_sink(*case, D ** -0.5, torch.empty_like(case[0]), out_rope=rope),
                       expected)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fused, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("rows", ["float", "fp8"])
def test_staging_rows_move_to_the_rings_in_the_attention_launch(device, num_splits, rows):
    """keep_rows (a decode step: no list reads a row the move writes) gives the attention and
    the window-ring move of keep_window_rows_ in one launch: the same output and the same
    pool, FP8 row bytes included; a padding token's target is its own staging row."""
    require_triton()
    from dsv4_kernels.kv_fp8 import FP8KVLayout
    from dsv4_kernels.sparse_attention import SparseAttnConfig, sparse_attn_with_sink
    from dsv4_kernels.window_ring import keep_window_rows_

    T, H, D, staging = len(LEN_A), 4, 128, 80
    q = torch.randn(T, H, D, device=device)
    layout = FP8KVLayout(D, 64, torch.float32) if rows == "fp8" else None
    pool = torch.randn(staging + 2 * T, D, device=device)
    pool = layout.pack(pool) if layout else pool
    idx_a, len_a = random_index_lists(T, 40, staging + T, LEN_A, device=device)  # rings and staging rows
    keep = torch.arange(staging + T, staging + 2 * T, dtype=torch.int32, device=device)  # ring rows nobody reads
    keep[3] = staging + 3
    case = (q, idx_a, len_a, None, None, None, torch.randn(H, device=device), D ** -0.5)

    def attend(kv, **kw):
        out = torch.full_like(q, float("nan"))
        sparse_attn_with_sink(case[0], kv, *case[1:], out, SparseAttnConfig(num_splits=num_splits),
                              kv_layout=layout, **kw)
        return out

    separate_pool = pool.clone()
    separate = attend(separate_pool)
    keep_window_rows_(separate_pool, staging, keep[:T - 1])
    fused_pool = pool.clone()
    fused = attend(fused_pool, keep_rows=(staging, keep[:T - 1]))  # the last token is not live
    assert torch.equal(fused, separate)
    assert torch.equal(fused_pool, separate_pool)
    assert torch.equal(fused_pool[staging + T:staging + 2 * T - 1][[0, 1, 2, 4, 5, 6]],
                       pool[staging:staging + T - 1][[0, 1, 2, 4, 5, 6]])
    assert torch.equal(fused_pool[-1], pool[-1])  # the row of the token past keep_loc's length


def _paged_lists(device, len_a, len_b, num_rows=3):
    """List a: c4 entries (ratio 4), list b: c128 entries of random page-table rows, both
    PageTableLists; pools covering every slot of the table."""
    T = len(len_a)
    context = 128 * max(len_b + [1])
    rtt = paged_page_table(num_rows, context, device=device, seed=T)
    rows = torch.randint(0, num_rows, (T,), device=device, dtype=torch.int32)
    lens = lambda v: torch.as_tensor(v, dtype=torch.int32, device=device)  # noqa: E731
    a = PageTableList(rtt, rows, 4, context // 4)
    b = PageTableList(rtt, rows, 128, context // 128)
    return a, lens(len_a), b, lens(len_b), num_rows * context


@pytest.mark.parametrize("paged", ["b", "ab"])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_lists_read_through_the_page_table_equal_their_gathered_lists(device, paged, num_splits):
    """The c128 entries (and any list) as a PageTableList: the Triton kernel gives exactly what
    it gives on the materialized lists, the reference too, and they agree."""
    require_triton()
    from dsv4_kernels.sparse_attention import SparseAttnConfig, sparse_attn_with_sink

    a, len_a, b, len_b, raw_slots = _paged_lists(device, LEN_A, LEN_B)
    H, D = 4, 64
    q = torch.randn(len(LEN_A), H, D, device=device)
    kv_a = torch.randn(raw_slots // 4, D, device=device)
    kv_b = torch.randn(raw_slots // 128, D, device=device)
    sink = torch.randn(H, device=device)
    if paged == "b":
        a = random_index_lists(len(LEN_A), 40, kv_a.shape[0], LEN_A, device=device)[0]
    listed_a = a if paged == "b" else a.gather(len_a)
    args = lambda ia, ib: (q, kv_a, ia, len_a, kv_b, ib, len_b, sink, 64 ** -0.5)  # noqa: E731
    config = SparseAttnConfig(num_splits=num_splits)
    got = sparse_attn_with_sink(*args(a, b), torch.full_like(q, float("nan")), config)
    listed = sparse_attn_with_sink(*args(listed_a, b.gather(len_b)), torch.full_like(q, float("nan")), config)
    assert torch.equal(got, listed)
    expected = reference.sparse_attn_with_sink(*args(a, b), torch.empty_like(q))
    assert torch.equal(expected, reference.sparse_attn_with_sink(*args(listed_a, b.gather(len_b)),
                                                                 torch.empty_like(q)))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert got[7].abs().max() == 0  # no valid entry: zeros


def test_reference_bounds_its_token_chunk_by_the_list_widths(monkeypatch):
    """At long context a token's lists are wide (c128: context / 128 entries); the reference
    then gathers fewer tokens at a time, with the same result."""
    a, len_a, b, len_b, raw_slots = _paged_lists("cpu", LEN_A, LEN_B)
    H, D = 4, 64
    q = torch.randn(len(LEN_A), H, D)
    args = (q, torch.randn(raw_slots // 4, D), a, len_a, torch.randn(raw_slots // 128, D), b, len_b,
            torch.randn(H), D ** -0.5)
    whole = reference.sparse_attn_with_sink(*args, torch.empty_like(q), token_chunk=64)
    chunks = []
    gather = reference._gather_keys
    monkeypatch.setattr(reference, "_gather_keys", lambda kv, idx, length, layout=None: (
        chunks.append(length.shape[0]), gather(kv, idx, length, layout))[1])
    monkeypatch.setattr(reference, "ATTN_REFERENCE_WORKSPACE_BYTES", 3 * (a.width + b.width) * (8 * D + 12 * H))
    got = reference.sparse_attn_with_sink(*args, torch.empty_like(q))
    assert chunks == [3, 3, 3, 3, 2, 2]  # lists a and b of tokens 0-2, 3-5, 6-7
    torch.testing.assert_close(got, whole, rtol=1e-6, atol=1e-6)


def test_triton_with_no_tokens_is_a_no_op(device):
    require_triton()
    from dsv4_kernels.sparse_attention import sparse_attn_with_sink

    q = torch.randn(0, 4, 64, device=device)
    kv = torch.randn(5, 64, device=device)
    idx = torch.zeros(0, 8, dtype=torch.int32, device=device)
    lens = torch.zeros(0, dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    assert sparse_attn_with_sink(q, kv, idx, lens, None, None, None, torch.randn(4, device=device),
                                 0.1, out) is out


# ------------------------------- GPU, real decode shapes -------------------------------------

H, D, WA, WB = 64, 512, 128, 512


def _real_case(T, Sa=4096, Sb=2048):
    len_a = torch.randint(0, WA + 1, (T,)).tolist()
    len_b = torch.randint(0, WB + 1, (T,)).tolist()
    len_a[0], len_b[0] = WA, WB  # a full decode row
    case = _random_case("cuda", torch.bfloat16, T, H, D, WA, WB, len_a, len_b, Sa, Sb)
    return case


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64, 257])
def test_gpu_real_shapes_match_reference(T):
    q, kv_a, idx_a, len_a, kv_b, idx_b, len_b, sink = _real_case(T)
    scale = D ** -0.5
    expected = reference.sparse_attn_with_sink(q, kv_a, idx_a, len_a, kv_b, idx_b, len_b, sink,
                                               scale, torch.empty(T, H, D, device="cuda"))
    out = ops.sparse_attn_with_sink(q, kv_a, idx_a, len_a, kv_b, idx_b, len_b, sink, scale,
                                    torch.empty_like(q))
    # bf16 output and bf16 probabilities in the PV dot.
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
    out_a = ops.sparse_attn_with_sink(q, kv_a, idx_a, len_a, None, None, None, sink, scale,
                                      torch.empty_like(q))
    expected_a = reference.sparse_attn_with_sink(q, kv_a, idx_a, len_a, None, None, None, sink,
                                                 scale, torch.empty(T, H, D, device="cuda"))
    torch.testing.assert_close(out_a.float(), expected_a, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 257])
def test_gpu_c128_entries_from_the_page_table_at_a_long_context(T):
    """A 1M-token context: each token's 8192 c128 entries read from the page table, bit-equal
    to the kernel over the materialized list."""
    context = 1 << 20
    len_b = torch.randint(0, context // 128 + 1, (T,)).tolist()
    len_b[0] = context // 128
    a, len_a, b, len_b, raw_slots = _paged_lists("cuda", torch.randint(0, WA + 1, (T,)).tolist(), len_b, num_rows=2)
    idx_a = random_index_lists(T, WA, 4096, len_a.tolist(), device="cuda")[0]
    q = torch.randn(T, H, D, device="cuda").bfloat16()
    kv_a = torch.randn(4096, D, device="cuda").bfloat16()
    kv_b = torch.randn(raw_slots // 128, D, device="cuda").bfloat16()
    sink = torch.randn(H, device="cuda")
    got = ops.sparse_attn_with_sink(q, kv_a, idx_a, len_a, kv_b, b, len_b, sink, D ** -0.5, torch.empty_like(q))
    want = ops.sparse_attn_with_sink(q, kv_a, idx_a, len_a, kv_b, b.gather(len_b), len_b, sink, D ** -0.5,
                                     torch.empty_like(q))
    assert torch.equal(got, want)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_reads_live_inputs():
    T = 48
    static = list(_real_case(T))
    out = torch.empty_like(static[0])
    args = lambda: (*static, D ** -0.5, out)  # noqa: E731
    ops.sparse_attn_with_sink(*args())  # warm-up compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.sparse_attn_with_sink(*args())
    fresh = _real_case(T)
    for buf, new in zip(static, fresh):
        buf.copy_(new)
    graph.replay()
    expected = ops.sparse_attn_with_sink(*fresh, D ** -0.5, torch.empty_like(out))
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_key_lists_split_only_into_splits_of_at_least_four_blocks():
    pick = pytest.importorskip("dsv4_kernels.sparse_attention").pick_num_splits
    # Under one wave of 132 SMs: 16 programs alone could split 8 ways, 1 program 16 ways.
    assert pick(16, 132) == 8 and pick(1, 132) == 16
    # A 128-key window list (dsv4-mini's c0 layers): 4 blocks of 32, so no split and no merge.
    assert pick(16, 132, width=128) == 1
    # Window + a 256-entry top-k list: 12 blocks, 2 splits of 6.
    assert pick(16, 132, width=128 + 256) == 2
    # Window + Flash's 512-entry top-k at one token: 20 blocks, capped at 4 splits.
    assert pick(2, 132, width=128 + 512) == 4
    # Long c128 lists: the wave decides, never more than MAX_SPLITS.
    assert pick(2, 132, width=128 + 8192) == 16 and pick(64, 132, width=10**6) == 2
    # Larger key blocks need longer lists for the same split.
    assert pick(16, 132, width=384, block_n=64) == 1
