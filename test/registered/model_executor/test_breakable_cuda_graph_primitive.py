"""Specification of the breakable-graph primitive on CPU (the emulator; docs/design.md, contracts 1, 2, 7)."""

import gc
import os
import weakref

import pytest
import torch

from sglang.srt.model_executor.breakable_cuda_graph import (
    BreakableGraphStaleError,
    EmulatedBreakableGraph,
    GraphCaptureError,
    create_breakable_graph,
    current_graph,
    eager_on_graph,
    get_split_ops,
    graph_memory_pool,
    is_capturing,
    register_split_op,
)

# ---- a small model with three break ops ---------------------------------------------


@eager_on_graph(name="test_breakable_gather_positive_rows")
def gather_positive_rows(scores: torch.Tensor, out: torch.Tensor) -> None:
    # Data-dependent work (nonzero, .item()) is legal here: break ops run eagerly.
    out.zero_()
    rows = (scores.sum(-1) > 0).nonzero().flatten()
    if rows.numel():
        out[: rows.numel()] = scores[rows] * scores.abs().max().item()


def _attention(q: torch.Tensor, kv: torch.Tensor, output: torch.Tensor, scale: float) -> None:
    output.copy_(torch.softmax(q @ kv.T * scale, dim=-1) @ kv)


attention = register_split_op("test_breakable_attention", _attention, mutates_args=("output",))


@eager_on_graph
def scale_rows_by_rank(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x * x.sum(-1).argsort().argsort().unsqueeze(-1))


class TinyModel:
    def __init__(self, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.w1 = torch.randn(16, 16, generator=gen)
        self.w2 = torch.randn(16, 16, generator=gen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = x @ self.w1
        h = torch.relu(pre)
        gathered = torch.empty_like(h)
        gather_positive_rows(pre, gathered)
        q = gathered + h.sin()
        kv = torch.tanh(x @ self.w2)
        attn_out = torch.empty_like(q)
        attention(q, kv, attn_out, 0.25)
        flat = attn_out.t().contiguous().view(-1)[:64].view(8, 8)  # views inside a segment
        y = torch.cat([flat, flat.cumsum(-1)], dim=-1).softmax(-1)
        out = torch.empty_like(y)
        scale_rows_by_rank(y, out)  # the very last call is a break
        return out


def _capture(fn, *inputs, debug=False):
    graph = create_breakable_graph("cpu", debug=debug)
    with graph.capture():
        out = fn(*inputs)
    return graph, out


# ---- replay == eager ----------------------------------------------------------------


@pytest.mark.parametrize("inference_mode", [False, True])
def test_replay_matches_eager_for_many_random_inputs(inference_mode):
    # Under inference mode composite ops (matmul, contiguous, ...) reach the emulator
    # undecomposed; both ways must replay exactly.
    model = TinyModel()
    static_x = torch.randn(8, 16)
    with torch.inference_mode(inference_mode):
        graph, out = _capture(model.forward, static_x)
    assert isinstance(graph, EmulatedBreakableGraph)
    assert graph.num_breaks == 3 and graph.num_segments == 4
    gen = torch.Generator().manual_seed(1)
    nonzero_rows_seen = set()
    for _ in range(25):
        x = torch.randn(8, 16, generator=gen) * 2
        static_x.copy_(x)
        graph.replay()
        with torch.inference_mode(inference_mode):
            expected = model.forward(x)
        assert torch.equal(out, expected)
        nonzero_rows_seen.add(int(((x @ model.w1).sum(-1) > 0).sum()))
    # The eager break really saw different data-dependent row counts across inputs.
    assert len(nonzero_rows_seen) > 1


def test_timed_replay_computes_what_replay_does_and_times_every_segment_and_break():
    model = TinyModel(seed=2)
    static_x = torch.randn(8, 16)
    graph, out = _capture(model.forward, static_x)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(5))
    static_x.copy_(x)
    segments, breaks = [], []
    graph.replay(host_seconds=(segments, breaks))
    assert len(segments) == graph.num_segments == 4 and len(breaks) == graph.num_breaks == 3
    assert all(s >= 0 for s in segments + breaks)
    assert torch.equal(out, model.forward(x))
    graph.release()
    with pytest.raises(RuntimeError, match="before capture"):
        graph.replay(host_seconds=([], []))


def test_replay_sees_state_written_in_place_by_earlier_replays():
    cache = torch.zeros(4, 8)
    step = torch.zeros((), dtype=torch.long)
    x = torch.zeros(8)

    def decode_step():
        cache.index_copy_(0, step.view(1) % 4, x.view(1, 8))  # KV-cache style write
        step.add_(1)
        return cache.sum(0) * step

    graph, out = _capture(decode_step)
    cache.zero_()
    step.zero_()
    ref_cache, ref_step = torch.zeros(4, 8), torch.zeros((), dtype=torch.long)
    for i in range(6):
        x.copy_(torch.full((8,), float(i + 1)))
        graph.replay()
        ref_cache[ref_step % 4] = x
        ref_step += 1
        assert torch.equal(out, ref_cache.sum(0) * ref_step)
    assert int(step) == 6


def test_zero_breaks_is_one_segment():
    x = torch.randn(4)
    graph, out = _capture(lambda: (x * 2).exp())
    assert graph.num_breaks == 0 and graph.num_segments == 1
    x.copy_(torch.tensor([0.0, 1.0, 2.0, 3.0]))
    graph.replay()
    assert torch.equal(out, (x * 2).exp())


def test_break_first_and_consecutive_breaks_give_empty_segments():
    x, mid, out = torch.randn(4), torch.empty(4), torch.empty(4)

    @eager_on_graph
    def plus_one(src, dst):
        dst.copy_(src + 1)

    def fn():
        plus_one(x, mid)
        plus_one(mid, out)
        return out * 3

    graph, result = _capture(fn)
    assert graph.num_breaks == 2 and graph.num_segments == 3
    assert graph.segment_op_names(0) == [] and graph.segment_op_names(1) == []
    x.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    graph.replay()
    assert result.tolist() == [9.0, 12.0, 15.0, 18.0]


def test_views_are_not_reexecuted_but_still_see_new_values():
    x = torch.zeros(2, 3)
    graph, out = _capture(lambda: x.t()[1:].unsqueeze(0) * 10)
    assert graph.segment_op_names(0) == ["aten.mul.Tensor"]
    x.copy_(torch.arange(6.0).view(2, 3))
    graph.replay()
    assert out.tolist() == [[[10.0, 40.0], [20.0, 50.0]]]


def test_in_place_metadata_ops_in_a_segment_are_not_applied_twice():
    v, w = torch.zeros(3), torch.randn(3, 3)

    def fn():
        a = (v @ w).unsqueeze(0)  # vector matmul does squeeze_ on its result internally
        a.t_()
        return a * 2

    graph, out = _capture(fn)
    for _ in range(3):
        v.copy_(torch.randn(3))
        graph.replay()
        assert out.shape == (3, 1)
        assert torch.equal(out, (v @ w).unsqueeze(1) * 2)


def test_replay_outside_inference_mode_of_an_inference_mode_capture():
    model = TinyModel(seed=3)
    static_x = torch.randn(8, 16)
    with torch.inference_mode():
        graph, out = _capture(model.forward, static_x)
    static_x.copy_(torch.randn(8, 16))
    graph.replay()
    with torch.inference_mode():
        assert torch.equal(out, model.forward(static_x.clone()))


# ---- frozen Python (design.md, contract 2) -------------------------------------------------------


def test_tensor_branch_in_segment_raises_naming_local_scalar_dense():
    x = torch.ones(4)

    def fn():
        return x * 2 if x.sum() > 0 else x * 3

    graph = create_breakable_graph("cpu")
    with pytest.raises(GraphCaptureError) as info:
        with graph.capture():
            fn()
    message = str(info.value)
    assert "aten._local_scalar_dense.default inside a breakable-graph segment" in message
    assert "host sync" in message and "break op" in message
    assert not graph.is_captured and not is_capturing()


def test_branch_on_python_value_is_frozen_at_capture():
    # The hazard of contract 2 (docs/design.md): a shortcut chosen by Python at capture is replayed forever.
    config = {"skip_indexer": True}
    x = torch.ones(3)

    def fn():
        return x * 2 if config["skip_indexer"] else x * 3

    graph, out = _capture(fn)
    config["skip_indexer"] = False
    x.copy_(torch.tensor([1.0, 2.0, 3.0]))
    graph.replay()
    assert out.tolist() == [2.0, 4.0, 6.0]  # captured branch
    assert fn().tolist() == [3.0, 6.0, 9.0]  # what eager does now


_x = torch.tensor([0.0, 1.0, 2.0, 0.0])
SCALAR = ("aten._local_scalar_dense", "aten.item")  # the latter under inference mode
# name -> (call, op names the error may start with)
FORBIDDEN = {
    "item": (lambda: _x[1].item(), SCALAR),
    "bool": (lambda: bool(_x[1]), SCALAR + ("aten.is_nonzero",)),
    "int": (lambda: int(_x[1]), SCALAR),
    "float": (lambda: float(_x[1]), SCALAR),
    "tolist": (lambda: _x.tolist(), ("torch.Tensor.tolist",)),
    "numpy": (lambda: _x.numpy(), ("torch.Tensor.numpy",)),
    "nonzero": (lambda: _x.nonzero(), ("aten.nonzero",)),
    "argwhere": (lambda: torch.argwhere(_x), ("aten.nonzero", "aten.argwhere")),
    "masked_select": (lambda: _x.masked_select(_x > 0), ("aten.masked_select",)),
    "unique": (lambda: torch.unique(_x), ("aten._unique2",)),
    "unique_consecutive": (lambda: torch.unique_consecutive(_x), ("aten.unique_consecutive",)),
    "repeat_interleave": (
        lambda: torch.repeat_interleave(_x, torch.tensor([1, 2, 0, 1])),
        ("aten.repeat_interleave.Tensor", "aten.repeat_interleave.self_Tensor"),
    ),
    "equal": (lambda: torch.equal(_x, _x), ("aten.equal",)),
    "is_nonzero": (lambda: torch.is_nonzero(_x[1:2]), SCALAR + ("aten.is_nonzero",)),
    "allclose": (lambda: torch.allclose(_x, _x), ("aten.allclose",)),
    "bincount": (lambda: torch.bincount(_x.long()), ("aten.bincount",)),
    "mask_index": (lambda: _x[_x > 0], ("aten.index.Tensor",)),
    "mask_index_put": (lambda: _x.clone().__setitem__(_x > 0, 1.0), ("aten.index_put_",)),
}


@pytest.mark.parametrize("inference_mode", [False, True])
@pytest.mark.parametrize("name", sorted(FORBIDDEN))
def test_host_syncs_and_dynamic_shapes_in_a_segment_raise_naming_the_op(name, inference_mode):
    fn, ops = FORBIDDEN[name]
    graph = create_breakable_graph("cpu")
    with torch.inference_mode(inference_mode), pytest.raises(GraphCaptureError) as info:
        with graph.capture():
            _x.add(0)
            fn()
    message = str(info.value)
    assert message.startswith(ops), message
    assert "inside a breakable-graph segment" in message and "host sync" in message
    assert not is_capturing()


@pytest.mark.parametrize("name", sorted(FORBIDDEN))
def test_the_same_ops_inside_a_break_op_are_fine(name):
    fn, _ = FORBIDDEN[name]
    ran = []

    @eager_on_graph
    def data_dependent():
        fn()
        ran.append(name)

    graph, _ = _capture(lambda: (_x + 1, data_dependent()))
    graph.replay()
    assert ran == [name, name] and graph.num_breaks == 1


_host = torch.tensor([1.0, 2.0])
# name -> (call, the call the error names): on a GPU each copies pageable host memory to the
# device, which a CUDA capture refuses; on the CPU emulator they are caught by name.
HOST_TO_DEVICE = {
    "tensor_on_a_device": (lambda: torch.tensor([1.0, 2.0], device="cpu"), "torch.tensor"),
    "as_tensor_on_a_device": (lambda: torch.as_tensor([1.0], device=_x.device), "torch.as_tensor"),
    "to_a_device": (lambda: _host.to(_x.device), "torch.Tensor.to"),
    "to_a_device_by_name": (lambda: _host.to("cpu"), "torch.Tensor.to"),
    "to_device_kwarg": (lambda: _host.to(device="cpu", dtype=torch.float64), "torch.Tensor.to"),
}


@pytest.mark.parametrize("name", sorted(HOST_TO_DEVICE))
def test_host_to_device_copies_in_a_segment_raise_naming_the_call(name):
    fn, call = HOST_TO_DEVICE[name]
    graph = create_breakable_graph("cpu")
    with pytest.raises(GraphCaptureError) as info:
        with graph.capture():
            _x.add(0)
            fn()
    message = str(info.value)
    assert message.startswith(call + " inside a breakable-graph segment: host-to-device copy"), message
    assert not is_capturing()


@pytest.mark.parametrize("name", sorted(HOST_TO_DEVICE))
def test_host_to_device_copies_inside_a_break_op_are_fine(name):
    fn, _ = HOST_TO_DEVICE[name]
    ran = []

    @eager_on_graph
    def copies():
        fn()
        ran.append(name)

    graph, _ = _capture(lambda: (_x + 1, copies()))
    graph.replay()
    assert ran == [name, name]


def test_host_scalars_and_dtype_moves_in_a_segment_are_not_copies():
    # A host 0-dim tensor is a kernel argument on CUDA, a dtype move stays on its device.
    x = torch.tensor([1.0, 2.0, 3.0])
    graph, out = _capture(lambda: (x * torch.tensor(2.0)).to(torch.float64) + x.to(x))
    x.copy_(torch.tensor([4.0, 5.0, 6.0]))
    graph.replay()
    assert out.tolist() == [12.0, 15.0, 18.0]


def test_repeat_interleave_with_output_size_is_allowed_and_replays():
    repeats = torch.tensor([1, 2, 1])
    values = torch.tensor([5.0, 6.0, 7.0])
    graph, out = _capture(lambda: torch.repeat_interleave(values, repeats, output_size=4))
    values.copy_(torch.tensor([1.0, 2.0, 3.0]))
    graph.replay()
    assert out.tolist() == [1.0, 2.0, 2.0, 3.0]


# ---- break op contract (design.md, contract 1) ---------------------------------------------------


def test_break_op_returning_a_value_raises_under_capture_only():
    @eager_on_graph(name="returns_sum")
    def returns_sum(x):
        return x.sum()

    x = torch.ones(3)
    assert returns_sum(x).item() == 3.0  # outside capture it is a plain call
    graph = create_breakable_graph("cpu")
    with pytest.raises(GraphCaptureError, match="break op 'returns_sum' returned a Tensor"):
        with graph.capture():
            returns_sum(x)
    assert not graph.is_captured and current_graph() is None


def test_capture_state_is_visible_to_break_ops_and_nested_break_ops_do_not_split():
    seen = []

    @eager_on_graph
    def inner(x):
        seen.append(("inner", is_capturing()))

    @eager_on_graph
    def outer(x):
        seen.append(("outer", current_graph() is graph))
        inner(x)

    graph = create_breakable_graph("cpu")
    assert not is_capturing()
    with graph.capture():
        assert is_capturing() and current_graph() is graph
        outer(torch.ones(1))
    assert not is_capturing() and current_graph() is None
    assert graph.num_breaks == 1 and [r.name for r in graph.break_records] == ["outer"]
    assert seen == [("outer", True), ("inner", True)]


def test_break_records_hold_the_exact_argument_objects_strongly():
    x = torch.randn(4)
    out = torch.empty(4)

    @eager_on_graph(name="scale")
    def scale(src, dst, factor):
        dst.copy_(src * factor)

    graph = create_breakable_graph("cpu")
    with graph.capture():
        temporary = x * 2
        scale(temporary, out, 0.5)
        temp_ref = weakref.ref(temporary)
        del temporary
    gc.collect()
    ((name, args, kwargs),) = graph.break_records
    assert name == "scale" and args[1] is out and args[2] == 0.5 and kwargs == {}
    assert args[0] is temp_ref()  # the temporary is alive and is the recorded object
    del args
    graph.release()
    gc.collect()
    assert temp_ref() is None


def test_release_is_idempotent_and_disables_replay():
    graph, _ = _capture(TinyModel().forward, torch.randn(8, 16))
    assert graph.is_captured
    graph.release()
    graph.release()
    assert not graph.is_captured and graph.num_segments == 0 and graph.break_records == []
    with pytest.raises(RuntimeError, match="replay"):
        graph.replay()


def test_capturing_twice_or_nested_is_refused():
    graph, _ = _capture(lambda: torch.ones(1) + 1)
    with pytest.raises(RuntimeError, match="already captured"):
        with graph.capture():
            pass
    outer = create_breakable_graph("cpu")
    with outer.capture():
        with pytest.raises(RuntimeError, match="already capturing"):
            with create_breakable_graph("cpu").capture():
                pass


def test_error_in_a_break_op_aborts_the_capture_cleanly():
    @eager_on_graph
    def broken(x):
        raise ValueError("boom")

    graph = create_breakable_graph("cpu")
    with pytest.raises(ValueError, match="boom"):
        with graph.capture():
            broken(torch.ones(1) * 2)
    assert not graph.is_captured and not is_capturing()
    graph2, out = _capture(lambda: torch.ones(2) * 2)  # the thread can capture again
    assert out.tolist() == [2.0, 2.0]


# ---- registered split ops -----------------------------------------------------------


def test_split_op_is_a_dispatcher_op_callable_outside_capture():
    q, kv, out = torch.randn(3, 4), torch.randn(5, 4), torch.empty(3, 4)
    torch.ops.sglang.test_breakable_attention(q, kv, out, 0.5)
    expected = torch.empty(3, 4)
    _attention(q, kv, expected, 0.5)
    assert torch.equal(out, expected)
    assert get_split_ops()["test_breakable_attention"] is attention
    schema = str(torch.ops.sglang.test_breakable_attention.default._schema)
    assert "Tensor(a2!) output" in schema and schema.endswith("-> ()")
    # The fake kernel makes it traceable on meta tensors.
    meta = [t.to("meta") for t in (q, kv, out)]
    assert torch.ops.sglang.test_breakable_attention(*meta, 0.5) is None


def test_calling_the_dispatcher_op_directly_under_capture_also_splits():
    q, kv, out = torch.zeros(2, 4), torch.randn(3, 4), torch.empty(2, 4)
    graph, result = _capture(
        lambda: (torch.ops.sglang.test_breakable_attention(q * 2, kv, out, 1.0), out + 1)[1]
    )
    assert [r.name for r in graph.break_records] == ["test_breakable_attention"]
    q.copy_(torch.randn(2, 4))
    graph.replay()
    expected = torch.empty(2, 4)
    _attention(q * 2, kv, expected, 1.0)
    assert torch.equal(result, expected + 1)


def test_registering_a_split_op_twice_is_refused():
    with pytest.raises(ValueError, match="already registered"):
        register_split_op("test_breakable_attention", _attention, ("output",))


# ---- debug mode ---------------------------------------------------------------------


def _capture_debug_attention():
    q, kv, out = torch.randn(8, 4), torch.randn(5, 4), torch.empty(8, 4)
    graph = create_breakable_graph("cpu", debug=True)
    with graph.capture():
        attention(q + 1, kv, out, 1.0)
        result = out * 2
    graph.replay()  # unchanged arguments pass the check
    return graph, out, result


def test_debug_detects_resize_of_a_break_argument():
    graph, out, _ = _capture_debug_attention()
    out.resize_(16, 4)
    with pytest.raises(BreakableGraphStaleError) as info:
        graph.replay()
    message = str(info.value)
    assert message.startswith("break 0 'test_breakable_attention' argument 'output': ")
    assert "shape changed (8, 4) -> (16, 4)" in message


def test_debug_detects_set_and_data_assignment_on_a_break_argument():
    graph, out, _ = _capture_debug_attention()
    before = out.data_ptr()
    out.set_(torch.empty(8, 4))
    moved = f"argument 'output': storage moved {before:#x} -> "
    with pytest.raises(BreakableGraphStaleError, match=moved):
        graph.replay()

    graph, out, _ = _capture_debug_attention()
    kv = graph.break_records[0].args[1]
    kv.data = torch.zeros(5, 4, dtype=torch.float64)
    with pytest.raises(BreakableGraphStaleError) as info:
        graph.replay()
    assert "argument 'kv': storage moved" in str(info.value)
    assert "dtype changed torch.float32 -> torch.float64" in str(info.value)


def test_without_debug_a_moved_argument_is_not_checked():
    q, kv, out = torch.randn(8, 4), torch.randn(5, 4), torch.empty(8, 4)
    graph = create_breakable_graph("cpu")
    with graph.capture():
        attention(q, kv, out, 1.0)
    old_storage = out.detach().clone()
    out.set_(torch.full((8, 4), float("nan")))
    graph.replay()  # no error: the break silently writes the new storage (debug mode's job)
    expected = torch.softmax(q @ kv.T, dim=-1) @ kv
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(old_storage, expected)


# ---- split ops captured inline (full graphs) ----------------------------------------

_live = {"scale": torch.tensor([2.0])}


def _scale_by_live_state(x: torch.Tensor, output: torch.Tensor) -> None:
    # Reads state outside its arguments, as the attention op reads backend.forward_metadata.
    output.copy_(x * _live["scale"])


scale_by_live_state = register_split_op("test_breakable_scale_by_live_state", _scale_by_live_state, ("output",))


def test_an_inline_split_op_replays_the_tensors_it_captured_not_the_live_state():
    from sglang.srt.model_executor.breakable_cuda_graph.break_op import break_ops_inline

    _live["scale"] = torch.tensor([2.0])
    x, out = torch.ones(3), torch.empty(3)
    graph = create_breakable_graph("cpu")
    with break_ops_inline(), graph.capture():
        scale_by_live_state(x + 0, out)
        y = out + 1
    # One segment holding the op's own aten ops, not the op: its Python never runs again.
    assert graph.segment_op_names(0) == ["aten.add.Tensor", "aten.mul.Tensor", "aten.copy_.default",
                                         "aten.add.Tensor"]
    x.fill_(3.0)
    graph.replay()
    torch.testing.assert_close(y, torch.full((3,), 7.0))
    # New storage for the live state (as a rebuilt metadata object has): a CUDA graph keeps
    # reading the captured tensor, and so does the emulator.
    _live["scale"] = torch.tensor([5.0])
    graph.replay()
    torch.testing.assert_close(y, torch.full((3,), 7.0))
    _live["scale"] = torch.tensor([2.0])


# ---- misc ---------------------------------------------------------------------------


def test_cpu_has_no_graph_memory_pool():
    assert graph_memory_pool("cpu") is None
    graph = create_breakable_graph(torch.device("cpu"), pool=None)
    assert isinstance(graph, EmulatedBreakableGraph)


def test_gloo_collective_inside_a_segment_replays(monkeypatch):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        x = torch.zeros(4)

        def fn():
            y = x * 2
            dist.all_reduce(y)
            return y + 1

        def functional_fn():
            return funcol.all_reduce(x * 2, "sum", dist.group.WORLD) + 1

        for body in (fn, functional_fn):
            graph, out = _capture(body)
            x.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
            graph.replay()
            assert out.tolist() == [3.0, 5.0, 7.0, 9.0]
            assert any("all_reduce" in n or "allreduce_" in n for n in graph.segment_op_names(0))
            graph.release()
            x.zero_()
    finally:
        dist.destroy_process_group()
