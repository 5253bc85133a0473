"""CPU emulator of a breakable CUDA graph (docs/design.md, contract 7).

Each segment is recorded as the list of aten ops it dispatched, against the tensor objects
they touched; replay re-executes those ops in order on the same objects. Like a CUDA graph,
no Python inside a segment runs again (branches are frozen) and storage never changes, so
stale-metadata and frozen-branch bugs fail on CPU exactly as they would on a GPU.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
from torch.utils._pytree import tree_leaves, tree_map

from sglang.srt.model_executor.breakable_cuda_graph.base import BreakableGraph
from sglang.srt.model_executor.breakable_cuda_graph.break_op import is_split_op, split_op_impl
from sglang.srt.model_executor.breakable_cuda_graph.guard import (
    SegmentDispatchGuard,
    SegmentHostReadGuard,
)

# Factories whose contents are undefined: a CUDA graph replays no kernel for them, so
# copying fresh garbage into the captured tensor would only cost time.
_UNINITIALISED_FACTORIES = {
    "aten::empty",
    "aten::empty_like",
    "aten::empty_strided",
    "aten::empty_permuted",
    "aten::new_empty",
    "aten::new_empty_strided",
}
# Functional collectives hand back a wrapper whose wait happens outside the dispatcher;
# at replay we wait on the fresh result ourselves, so the wrapping op has nothing to do.
_FUNCTIONAL_COLLECTIVES = "_c10d_functional::"
_SKIPPED_OPS = {"_c10d_functional::_wrap_tensor_autograd"}


def _output_leaves(func, out: Any) -> list[tuple[bool, Any]]:
    """(aliases an input per the schema, object) for every returned value, lists flattened."""
    returns = func._schema.returns
    per_return = [out] if len(returns) == 1 else list(out or ())
    leaves = []
    for ret, value in zip(returns, per_return):
        aliased = ret.alias_info is not None
        items = value if isinstance(value, (list, tuple)) else [value]
        leaves.extend((aliased, item) for item in items)
    return leaves


def _is_work(obj: Any) -> bool:
    # Legacy c10d collectives (dist.all_reduce, ...) return a Work whose wait() Python
    # calls after the op; the wait is not an op, so replay has to do it.
    if isinstance(obj, torch.ScriptObject):
        try:
            return obj._type().qualified_name().endswith(".Work")
        except RuntimeError:
            return False
    return type(obj).__name__ == "Work" and hasattr(obj, "wait")


def _storage_ptr(value: Any) -> Optional[int]:
    if not isinstance(value, torch.Tensor):
        return None
    try:
        return value.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # wrapper subclasses have no storage
        return None


def _is_same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


@dataclass(eq=False)
class RecordedOp:
    """One dispatched op and how to redo it so the captured tensors get the new values.

    Tensors are held as aliases of the captured objects (same storage, metadata frozen at
    the time of the op), see `_pin`.
    """

    func: Any
    args: tuple
    kwargs: dict
    # Fresh (non-aliasing) outputs: replay copies the new result into these captured objects,
    # which is what the ops recorded after this one hold.
    copy_targets: tuple[tuple[int, torch.Tensor], ...]
    wait_leaves: tuple[int, ...]
    waits_functional_collective: bool

    def replay(self) -> None:
        result = self.func(*self.args, **self.kwargs)
        if not self.copy_targets and not self.wait_leaves:
            return
        leaves = [leaf for _, leaf in _output_leaves(self.func, result)]
        for index in self.wait_leaves:
            leaves[index].wait()
        for index, target in self.copy_targets:
            fresh = leaves[index]
            if self.waits_functional_collective:
                fresh = torch.ops._c10d_functional.wait_tensor(fresh)
            if not _is_same_view(fresh, target):
                target.copy_(fresh)


def plan_replay(func, args: tuple, kwargs: dict, out: Any) -> Optional[RecordedOp]:
    """How to replay `func`, or None when replay has nothing to do for it."""
    schema = func._schema
    # Metadata-only in-place ops (transpose_, resize_, set_, ...) change the tensor object,
    # not its data; the object already has its post-capture metadata, and running them
    # again would apply them twice. Like a CUDA graph, which has no kernel for them.
    if torch.Tag.inplace_view in func.tags or schema.name in _SKIPPED_OPS:
        return None
    writes = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
    if not writes and schema.name in _UNINITIALISED_FACTORIES:
        return None
    leaves = _output_leaves(func, out)
    # `Tensor(a)` in a schema means "may alias": reshape, contiguous and to (which reach us
    # undecomposed under inference mode) return a fresh tensor when they cannot view.
    # Only an output that really shares an input's storage is a view.
    input_storages = {_storage_ptr(t) for t in tree_leaves((args, kwargs))} - {None}
    leaves = [
        (aliased and _storage_ptr(leaf) in input_storages, leaf) for aliased, leaf in leaves
    ]
    # Pure views: the captured view object still aliases the same storage with the same
    # metadata, so it already shows whatever the ops before it wrote. Re-running would only
    # build a new view object that nothing reads.
    if not writes and leaves and all(aliased for aliased, _ in leaves):
        return None
    copy_targets = tuple(
        (i, _pin(leaf))
        for i, (aliased, leaf) in enumerate(leaves)
        if not aliased and isinstance(leaf, torch.Tensor)
    )
    wait_leaves = tuple(i for i, (_, leaf) in enumerate(leaves) if _is_work(leaf))
    waits_functional = schema.name.startswith(_FUNCTIONAL_COLLECTIVES) and not schema.name.endswith(
        "::wait_tensor"
    )
    args, kwargs = tree_map(_pin, (args, kwargs))
    return RecordedOp(func, args, kwargs, copy_targets, wait_leaves, waits_functional)


def _pin(value: Any) -> Any:
    """An alias of a plain tensor frozen with its current shape, strides and storage.

    Later in-place metadata ops (`squeeze_`, `t_`, `set_`, `resize_`; matmul of a vector
    does `squeeze_` on its result) change the tensor *object*, but the ops recorded before
    them ran on the old metadata and storage; a CUDA graph keeps those, so we keep them
    too. Subclasses (e.g. collective wrappers) are kept as they are.
    """
    if type(value) is torch.Tensor or type(value) is torch.nn.Parameter:
        return value.detach()
    return value


class _RecordingMode(SegmentDispatchGuard):
    def _run(self, func, args: tuple, kwargs: dict) -> Any:
        if is_split_op(func):  # reached only with break ops inline (a full graph)
            # Record what the op's Python dispatches, not the op: replaying the op would run
            # its Python again and read live state (say backend.forward_metadata), where a
            # CUDA graph replays the kernels it captured on the tensors captured then.
            with self:
                split_op_impl(func)(*args, **kwargs)
            return None
        out = func(*args, **kwargs)
        self._graph._record(func, args, kwargs, out)
        return out


class EmulatedBreakableGraph(BreakableGraph):
    """Breakable graph for CPU (or any device without CUDA graphs)."""

    def __init__(self, device: torch.device | str = "cpu", *, debug: bool = False):
        super().__init__(device, debug=debug)
        # Each RecordedOp holds its argument and output tensors, so every tensor a segment
        # touched stays alive (and keeps its storage) until release().
        self._segments: list[list[RecordedOp]] = []

    def segment_op_names(self, index: int) -> list[str]:
        """What segment `index` re-executes at replay, e.g. ['aten.mul.Tensor', ...]."""
        return [str(op.func) for op in self._segments[index]]

    @contextlib.contextmanager
    def _capture_context(self) -> Iterator[None]:
        # Both modes stay pushed for the whole capture and pass through while a break op
        # runs: pushing and popping them around each break would be unsafe when the break
        # is entered from inside the dispatch mode (a split op called via torch.ops).
        with SegmentHostReadGuard(self), _RecordingMode(self):
            yield

    def _record(self, func, args: tuple, kwargs: dict, out: Any) -> None:
        op = plan_replay(func, args, kwargs, out)
        if op is not None:
            self._segments[-1].append(op)

    def _begin_segment(self) -> None:
        self._segments.append([])

    def _end_segment(self) -> None:
        pass

    def _abort_segment(self) -> None:
        pass

    def _replay_segment(self, index: int) -> None:
        for op in self._segments[index]:
            op.replay()

    def _release_segments(self) -> None:
        self._segments = []
