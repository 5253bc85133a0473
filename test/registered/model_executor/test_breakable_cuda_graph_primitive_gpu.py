"""Specification of the breakable-graph primitive with real CUDA graphs (one GPU)."""

import gc
import warnings
import weakref

import pytest
import torch

from sglang.srt.model_executor.breakable_cuda_graph import (
    BreakableGraphStaleError,
    CudaBreakableGraph,
    GraphCaptureError,
    create_breakable_graph,
    eager_on_graph,
    graph_memory_pool,
    is_capturing,
    register_split_op,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@eager_on_graph(name="test_breakable_gpu_gather_positive_rows")
def gather_positive_rows(scores: torch.Tensor, out: torch.Tensor) -> None:
    # nonzero and .item() sync with the host: legal here, because break ops run eagerly.
    out.zero_()
    rows = (scores.sum(-1) > 0).nonzero().flatten()
    if rows.numel():
        out[: rows.numel()] = scores[rows] * scores.abs().max().item()


def _attention(q: torch.Tensor, kv: torch.Tensor, output: torch.Tensor, scale: float) -> None:
    output.copy_(torch.softmax(q @ kv.T * scale, dim=-1) @ kv)


attention = register_split_op("test_breakable_gpu_attention", _attention, mutates_args=("output",))


class TinyModel:
    def __init__(self, seed: int = 0):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.w1 = torch.randn(64, 64, device="cuda", generator=gen)
        self.w2 = torch.randn(64, 64, device="cuda", generator=gen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = x @ self.w1
        gathered = torch.empty_like(pre)
        gather_positive_rows(pre, gathered)
        q = gathered + pre.relu().sin()
        kv = torch.tanh(x @ self.w2)
        attn_out = torch.empty_like(q)
        attention(q, kv, attn_out, 0.125)
        return torch.cat([attn_out, attn_out.cumsum(-1)], dim=-1).softmax(-1)


def _warm_up_and_capture(graph, fn, *inputs):
    for _ in range(2):  # warm-up is the caller's job
        fn(*inputs)
    torch.cuda.synchronize()
    with graph.capture():
        out = fn(*inputs)
    torch.cuda.synchronize()
    return out


def test_cuda_replay_matches_eager_for_many_random_inputs():
    model = TinyModel()
    static_x = torch.randn(16, 64, device="cuda")
    graph = create_breakable_graph("cuda")
    out = _warm_up_and_capture(graph, model.forward, static_x)
    assert isinstance(graph, CudaBreakableGraph) and graph.pool == graph_memory_pool("cuda")
    assert graph.num_breaks == 2 and graph.num_segments == 3
    for _ in range(20):
        x = torch.randn(16, 64, device="cuda")
        static_x.copy_(x)
        graph.replay()
        torch.testing.assert_close(out, model.forward(x), rtol=0, atol=0)
    graph.release()


def test_zero_breaks_is_one_cuda_graph():
    x = torch.zeros(32, device="cuda")
    graph = create_breakable_graph("cuda")
    out = _warm_up_and_capture(graph, lambda: (x * 2).exp())
    assert graph.num_segments == 1 and graph.num_breaks == 0
    x.copy_(torch.arange(32.0, device="cuda") / 32)
    graph.replay()
    assert torch.equal(out, (x * 2).exp())


def test_break_first_and_last_leave_empty_segments_silently():
    x, mid, out = (torch.zeros(8, device="cuda") for _ in range(3))

    @eager_on_graph
    def plus_one(src, dst):
        dst.copy_(src + 1)

    def fn():
        plus_one(x, mid)
        y = mid * 3
        plus_one(y, out)

    graph = create_breakable_graph("cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "The CUDA Graph is empty" must not leak out
        _warm_up_and_capture(graph, fn)
        assert graph.num_segments == 3
        x.copy_(torch.arange(8.0, device="cuda"))
        graph.replay()
    assert out.tolist() == [(i + 1) * 3 + 1 for i in range(8)]


def test_side_stream_forked_and_joined_inside_a_segment():
    x = torch.zeros(1024, device="cuda")
    out = torch.empty(1024, device="cuda")

    @eager_on_graph
    def double_into(src, dst):
        dst.copy_(src * 2)

    def fn():
        main = x.sin()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            branch = (x + 1).exp()
        torch.cuda.current_stream().wait_stream(side)
        double_into(main + branch, out)
        return out - branch

    graph = create_breakable_graph("cuda")
    result = _warm_up_and_capture(graph, fn)
    for _ in range(5):
        x.copy_(torch.randn(1024, device="cuda"))
        graph.replay()
        torch.testing.assert_close(result, fn(), rtol=0, atol=0)


def test_two_graphs_sharing_one_pool_replay_in_alternation():
    model = TinyModel(seed=1)
    pool = graph_memory_pool("cuda")
    buckets = {}
    for num_tokens in (32, 8):  # largest first, as a runner captures
        static_x = torch.randn(num_tokens, 64, device="cuda")
        graph = create_breakable_graph("cuda", pool=pool)
        out = _warm_up_and_capture(graph, model.forward, static_x)
        buckets[num_tokens] = (graph, static_x, out)
    assert buckets[32][0].pool is buckets[8][0].pool
    for step in range(12):
        graph, static_x, out = buckets[32 if step % 2 else 8]
        x = torch.randn_like(static_x)
        static_x.copy_(x)
        graph.replay()
        torch.testing.assert_close(out, model.forward(x), rtol=0, atol=0)


def test_host_sync_in_a_segment_fails_capture_with_graph_capture_error():
    x = torch.ones(16, device="cuda")
    graph = create_breakable_graph("cuda")
    with pytest.raises(GraphCaptureError, match="CUDA stream capture failed"):
        with graph.capture():
            y = x * 2
            if y.sum().item() > 0:
                y = y + 1
    assert not graph.is_captured and not is_capturing()
    # The failure leaves CUDA usable: the next capture works.
    graph = create_breakable_graph("cuda")
    out = _warm_up_and_capture(graph, lambda: x * 3)
    x.fill_(2.0)
    graph.replay()
    assert out.tolist() == [6.0] * 16


@pytest.mark.parametrize(
    "call, op",
    [
        (lambda x: x.nonzero(), "aten.nonzero"),
        (lambda x: bool(x[0] > 0), "aten."),
        (lambda x: x.tolist(), "torch.Tensor.tolist"),
    ],
)
def test_debug_capture_names_the_host_sync_op(call, op):
    x = torch.ones(16, device="cuda")
    graph = create_breakable_graph("cuda", debug=True)
    with pytest.raises(GraphCaptureError) as info:
        with graph.capture():
            call(x * 2)
    assert str(info.value).startswith(op) and "inside a breakable-graph segment" in str(info.value)


def test_debug_replay_detects_a_resized_break_argument():
    q, kv = torch.randn(8, 16, device="cuda"), torch.randn(4, 16, device="cuda")
    out = torch.empty(8, 16, device="cuda")
    graph = create_breakable_graph("cuda", debug=True)
    result = _warm_up_and_capture(graph, lambda: (attention(q * 2, kv, out, 1.0), out + 1)[1])
    graph.replay()
    torch.cuda.synchronize()
    expected = torch.empty_like(out)
    _attention(q * 2, kv, expected, 1.0)
    torch.testing.assert_close(result, expected + 1, rtol=0, atol=0)
    out.resize_(32, 16)
    stale = "break 0 'test_breakable_gpu_attention' argument 'output': storage moved"
    with pytest.raises(BreakableGraphStaleError, match=stale):
        graph.replay()


def test_pool_resident_break_inputs_stay_alive_until_release():
    x = torch.randn(256, device="cuda")
    out = torch.empty(256, device="cuda")

    @eager_on_graph
    def copy_into(src, dst):
        dst.copy_(src)

    graph = create_breakable_graph("cuda")
    for _ in range(2):
        copy_into(x * 2, out)
    with graph.capture():
        temporary = x * 2  # allocated from the graph pool
        copy_into(temporary, out)
        ref, ptr = weakref.ref(temporary), temporary.data_ptr()
        del temporary
    gc.collect()
    assert ref() is not None and ref().data_ptr() == ptr
    x.fill_(1.5)
    graph.replay()
    assert out.tolist() == [3.0] * 256
    graph.release()
    graph.release()
    gc.collect()
    assert ref() is None and graph.num_segments == 0
    # The shared pool outlives its graphs: capturing into it again works.
    again = create_breakable_graph("cuda")
    result = _warm_up_and_capture(again, lambda: x + 1)
    x.fill_(0.5)
    again.replay()
    assert result.tolist() == [1.5] * 256


def _scaled_copy(q: torch.Tensor, output: torch.Tensor, scale: float) -> None:
    output.copy_(q * scale)


scaled_copy = register_split_op("test_breakable_gpu_scaled_copy", _scaled_copy, mutates_args=("output",),
                                transient=("q", "output"))


def _layers(x: torch.Tensor, num_layers: int) -> torch.Tensor:
    """`num_layers` blocks of 4 MiB activations, each through one transient break."""
    h = x
    for i in range(num_layers):
        q = h.repeat(1, 16) + i  # [256, 4096] fp32: 4 MiB, allocated in the segment
        out = torch.empty_like(q)
        scaled_copy(q, out, 0.5)
        h = out[:, :256].tanh() + h
    return h


def _pool_bytes_for(num_layers: int) -> tuple[int, torch.Tensor, torch.Tensor, object]:
    x = torch.randn(256, 256, device="cuda")
    pool = torch.cuda.graph_pool_handle()  # a fresh pool: its growth is this graph's alone
    graph = create_breakable_graph("cuda", pool=pool)
    for _ in range(2):
        _layers(x, num_layers)
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    with graph.capture():
        out = _layers(x, num_layers)
    torch.cuda.synchronize()
    return torch.cuda.memory_reserved() - before, x, out, graph


def test_transient_break_arguments_are_reused_layer_after_layer():
    few, *_ = _pool_bytes_for(2)
    many, x, out, graph = _pool_bytes_for(24)
    # Held strongly, 24 layers would keep 24 x 8 MiB of q and output; reused, the pool holds
    # a couple of layers' worth, as for 2 layers.
    assert many < few + 32 * 2**20, (few, many)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.testing.assert_close(out, _layers(x, 24), rtol=0, atol=0)


def test_a_transient_argument_not_made_by_the_capture_is_refused():
    made_eagerly = torch.randn(64, 64, device="cuda")
    graph = create_breakable_graph("cuda")
    with pytest.raises(GraphCaptureError, match="argument 'q' is declared transient"):
        with graph.capture():
            out = torch.empty_like(made_eagerly)
            scaled_copy(made_eagerly, out, 2.0)
