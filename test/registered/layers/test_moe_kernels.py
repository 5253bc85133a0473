"""RoutedExperts through sgl-kernel's grouped-GEMM MoE (dsv4_kernels fused_moe) against the
model's dense torch path: chosen only inside a forward pass whose backend runs segment
kernels, and equal to the dense path with hash-table duplicates and DP expert shards, both
through the torch reference (what the CPU model runs) and the Triton kernels (interpreted on
CPU, compiled on a GPU)."""

import types

import pytest
import torch
import torch.nn.functional as F

from dsv4_kernels import ops

from sglang.srt.layers.moe.experts import RoutedExperts
from sglang.srt.layers.moe.router import route
from sglang.srt.model_executor.forward_context import forward_context

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _segment_backend(on: bool):
    return types.SimpleNamespace(segment_kernels=on)


def _experts(E, d, inter, limit, dtype, g, device=DEVICE):
    experts = RoutedExperts(E, d, inter, limit, dtype)
    for p, scale in ((experts.w1, d ** -0.5), (experts.w3, d ** -0.5), (experts.w2, inter ** -0.5)):
        p.copy_(torch.randn(p.shape, generator=g) * 2 * scale)
    return experts.to(device)


def _grouped(experts, x, w, ids):
    with forward_context(None, _segment_backend(True), x.shape[0]):
        return experts(x, w, ids)


@pytest.fixture(params=["reference", "triton"])
def fused_calls(request, monkeypatch):
    """The grouped path's ops.fused_moe calls, run by the torch reference or by the Triton
    kernels (ops dispatches on the device: on CPU the kernels are forced in and run under the
    interpreter). Counted, so a test that passes because the dense path ran instead fails."""
    if request.param == "triton":
        pytest.importorskip("triton")
        from dsv4_kernels import moe

        if DEVICE == "cpu":
            if type(moe._gate_up_kernel).__name__ != "InterpretedFunction":
                pytest.skip("dsv4_kernels.moe was imported before TRITON_INTERPRET was set")
            monkeypatch.setattr(ops, "_use_triton", lambda t: True)
    elif DEVICE == "cuda":
        pytest.skip("ops sends CUDA tensors to Triton; the reference path is the CPU one")
    calls = []
    real = ops.fused_moe

    def counted(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(ops, "fused_moe", counted)
    return calls


def _one_expert(experts, e, v, weight):
    """One expert on one row, written out (fp32 weights): the routing weight scales the
    clamped SwiGLU activation before W2."""
    gate, up = experts.w1[e] @ v, experts.w3[e] @ v
    if experts.limit > 0:
        gate, up = gate.clamp(max=experts.limit), up.clamp(-experts.limit, experts.limit)
    return experts.w2[e] @ (F.silu(gate) * up * weight)


def _hash_routing(E, k, g, table_rows, T):
    """route() with a token -> experts table (DSV4's hash layers): an expert listed twice for
    a token gets the same gate score at both places."""
    table = torch.tensor(table_rows, dtype=torch.int32)
    input_ids = torch.arange(T) % len(table_rows)
    logits = torch.randn(T, E, generator=g)
    return route(logits, k, 1.5, "sqrtsoftplus", tid2eid=table, input_ids=input_ids)


def test_grouped_path_only_inside_a_segment_kernel_forward_pass(fused_calls):
    g = torch.Generator().manual_seed(0)
    experts = _experts(4, 16, 24, 1.0, torch.float32, g)
    x = torch.randn(3, 16, generator=g).to(DEVICE)
    w, ids = route(torch.randn(3, 4, generator=g), 2, 1.5, "sqrtsoftplus")
    w, ids = w.to(DEVICE), ids.to(DEVICE)
    experts(x, w, ids)  # no forward pass in flight
    with forward_context(None, _segment_backend(False), 3):
        experts(x, w, ids)
    with forward_context(None, types.SimpleNamespace(), 3):  # a backend without the switch
        experts(x, w, ids)
    assert fused_calls == []
    out = _grouped(experts, x, w, ids)
    assert len(fused_calls) == 1 and out.dtype == torch.float32 and out.shape == x.shape


@pytest.mark.parametrize("limit", [0.0, 1.0])
def test_grouped_path_equals_dense_path_with_hash_duplicates(fused_calls, limit):
    g = torch.Generator().manual_seed(1)
    E, d, inter, k, T = 6, 32, 40, 3, 11
    experts = _experts(E, d, inter, limit, torch.float32, g)
    # duplicate pairs (first/last, adjacent), a triple, and plain rows
    w, ids = _hash_routing(E, k, g, [[2, 5, 2], [1, 1, 4], [3, 3, 3], [0, 4, 5], [5, 2, 1]], T)
    x = (torch.randn(T, d, generator=g) * 2).to(DEVICE)  # large enough that the clamps engage
    w, ids = w.to(DEVICE), ids.to(DEVICE)
    dense = experts(x, w, ids)
    got = _grouped(experts, x, w, ids)
    assert len(fused_calls) == 1
    torch.testing.assert_close(got, dense, rtol=1e-5, atol=1e-5)
    # a duplicated expert counts once: row 0 is experts 2 and 5 at their gate weights, row 2
    # expert 3 alone (listed three times)
    assert w[0, 0] == w[0, 2] and w[2, 0] == w[2, 1] == w[2, 2]
    row0 = _one_expert(experts, 2, x[0], w[0, 0]) + _one_expert(experts, 5, x[0], w[0, 1])
    torch.testing.assert_close(got[0], row0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[2], _one_expert(experts, 3, x[2], w[2, 0]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shard", [(0, 3), (2, 5), (5, 8)])
def test_grouped_path_equals_dense_path_on_a_dp_expert_shard(fused_calls, shard):
    """keep_shard_: routing ids index all 8 experts, this rank holds [start, end); rows routed
    to other ranks' experts contribute exactly zero here, also a row with none of ours."""
    g = torch.Generator().manual_seed(2)
    E, d, inter, k, T = 8, 24, 32, 2, 13
    start, end = shard
    experts = _experts(E, d, inter, 1.0, torch.float32, g)
    full = _experts(E, d, inter, 1.0, torch.float32, torch.Generator().manual_seed(2))
    experts.keep_shard_(start, end)
    outside = [e for e in range(E) if not start <= e < end]
    rows = [[outside[0], outside[-1]], [start, outside[1]], [end - 1, start], [start + 1, start + 1],
            [outside[1], end - 1]]
    w, ids = _hash_routing(E, k, g, rows, T)
    x = torch.randn(T, d, generator=g).to(DEVICE)
    w, ids = w.to(DEVICE), ids.to(DEVICE)
    dense = experts(x, w, ids)
    got = _grouped(experts, x, w, ids)
    assert len(fused_calls) == 1
    torch.testing.assert_close(got, dense, rtol=1e-5, atol=1e-5)
    no_expert_here = torch.arange(T, device=DEVICE) % len(rows) == 0
    assert got[no_expert_here].eq(0).all() and dense[no_expert_here].eq(0).all()
    # the shards of all ranks add up to the unsharded experts
    total = torch.zeros_like(got)
    for s, e in ((0, 3), (3, 5), (5, 8)):
        part = _experts(E, d, inter, 1.0, torch.float32, torch.Generator().manual_seed(2))
        part.keep_shard_(s, e)
        total += _grouped(part, x, w, ids)
    torch.testing.assert_close(total, full(x, w, ids), rtol=1e-5, atol=1e-5)


def test_grouped_path_weights_the_activation_before_w2_like_the_dense_path(fused_calls):
    """fp16: unclamped SwiGLU activations of ~1e5 overflow fp16 unless the routing weight
    scales them before the cast for W2, which the dense path does; so must the grouped one."""
    g = torch.Generator().manual_seed(3)
    E, d, inter, k, T = 3, 16, 16, 2, 4
    experts = RoutedExperts(E, d, inter, 0.0, torch.float16).to(DEVICE)
    experts.w1.copy_(torch.rand(E, inter, d, generator=g) * 0.5 + 9.5)
    experts.w3.copy_(torch.rand(E, inter, d, generator=g) * 0.5 + 9.5)
    experts.w2.copy_(torch.rand(E, d, inter, generator=g) * 0.01)
    x = (2 + torch.rand(T, d, generator=g) / 4).half().to(DEVICE)
    w, ids = _hash_routing(E, k, g, [[0, 1], [2, 2], [1, 2]], T)
    w, ids = (w / 40).to(DEVICE), ids.to(DEVICE)  # DSV4 scales ~1.5-2.5; small enough to fit here
    gate = F.silu(x.float() @ experts.w1[0].float().t()) * (x.float() @ experts.w3[0].float().t())
    assert gate.max() > torch.finfo(torch.float16).max  # unweighted, h would be inf
    dense = experts(x, w, ids)
    got = _grouped(experts, x, w, ids)
    assert len(fused_calls) == 1
    assert torch.isfinite(dense).all() and torch.isfinite(got).all()
    torch.testing.assert_close(got, dense, rtol=2e-3, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("T", [1, 7, 300])
def test_gpu_bf16_grouped_path_matches_dense_and_replays_from_a_cuda_graph(T):
    """Real tile sizes, bf16, DP shard with duplicates: the grouped path matches the dense one
    (bf16 rounding apart: the dense path rounds gate/up to bf16, the kernels keep them fp32),
    and captured once, it replays fresh routing without a host sync."""
    g = torch.Generator().manual_seed(4)
    E, d, inter, k = 64, 1024, 512, 6
    experts = _experts(E, d, inter, 10.0, torch.bfloat16, g, device="cuda")
    experts.keep_shard_(8, 40)  # some of every seed's picks fall inside, some outside

    def inputs(seed):
        gg = torch.Generator().manual_seed(seed)
        x = torch.randn(T, d, generator=gg).bfloat16().cuda()
        logits = torch.randn(T, E, generator=gg)
        w, ids = route(logits, k, 2.5, "sqrtsoftplus")
        ids[::3, 1] = ids[::3, 0]  # hash-style duplicates with the same weight
        w[::3, 1] = w[::3, 0]
        return x, w.cuda(), ids.cuda()

    x, w, ids = inputs(5)
    dense = experts(x, w, ids)
    got = _grouped(experts, x, w, ids)
    scale = dense.abs().max().item()
    assert scale > 0
    torch.testing.assert_close(got, dense, rtol=0, atol=2e-2 * scale)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _grouped(experts, x, w, ids)  # warm-up: Triton compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = _grouped(experts, x, w, ids)
    x2, w2, ids2 = inputs(6)
    x.copy_(x2)
    w.copy_(w2)
    ids.copy_(ids2)
    graph.replay()
    torch.testing.assert_close(static_out, _grouped(experts, x2, w2, ids2), rtol=0, atol=0)
