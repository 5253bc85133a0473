"""sparse_attn_with_sink: one sink-softmax over the union of window and compressed entries."""

import math

import pytest
import torch

from dsv4_kernels import ops, reference
from kernel_test_utils import random_index_lists, require_triton


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
