"""Rejects host syncs, data-dependent shapes and host-to-device copies in graph segments.

A real CUDA capture fails on these (or would freeze a value read at capture time), so the
CPU emulator must fail the same way for CPU tests to catch what the GPU would. In debug mode
the CUDA path uses the same modes to name the op instead of surfacing a bare CUDA error.
Break ops run eagerly, so everything is allowed inside them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from sglang.srt.model_executor.breakable_cuda_graph.break_op import break_ops_are_inline, is_split_op
from sglang.srt.model_executor.breakable_cuda_graph.errors import GraphCaptureError

if TYPE_CHECKING:
    from sglang.srt.model_executor.breakable_cuda_graph.base import BreakableGraph

HOST_SYNC = "host sync (a tensor value is read back into Python)"
HOST_TO_DEVICE = ("host-to-device copy (a CUDA capture refuses copies from pageable host memory: "
                  "build the tensor on the device once, outside the graph)")
DATA_DEPENDENT_SHAPE = "data-dependent output shape (host sync)"

# Keyed by schema name so every overload (default, out, ...) is covered.
_FORBIDDEN_OPS = {
    # .item(), bool(t), int(t), float(t), `if t > 0:` all end here.
    "aten::_local_scalar_dense": HOST_SYNC,
    # Under inference mode composite ops reach Python undecomposed, so list them too.
    "aten::item": HOST_SYNC,
    "aten::is_nonzero": HOST_SYNC,
    "aten::equal": HOST_SYNC,
    "aten::allclose": HOST_SYNC,
    "aten::nonzero": DATA_DEPENDENT_SHAPE,
    "aten::argwhere": DATA_DEPENDENT_SHAPE,
    "aten::nonzero_numpy": DATA_DEPENDENT_SHAPE,
    "aten::masked_select": DATA_DEPENDENT_SHAPE,
    "aten::_unique": DATA_DEPENDENT_SHAPE,
    "aten::_unique2": DATA_DEPENDENT_SHAPE,
    "aten::unique_dim": DATA_DEPENDENT_SHAPE,
    "aten::unique_consecutive": DATA_DEPENDENT_SHAPE,
    "aten::unique_dim_consecutive": DATA_DEPENDENT_SHAPE,
    # Output length is max(input) + 1.
    "aten::bincount": DATA_DEPENDENT_SHAPE,
}
# Boolean-mask indexing (x[mask], x[mask] = v) runs nonzero inside the kernel.
_MASK_INDEXING_OPS = {
    "aten::index",
    "aten::_unsafe_index",
    "aten::index_put",
    "aten::index_put_",
    "aten::_index_put_impl",
    "aten::_index_put_impl_",
}
# Tensor methods that read data on the host without dispatching an aten op on CPU.
_HOST_READ_METHODS = {
    torch.Tensor.tolist: "torch.Tensor.tolist",
    torch.Tensor.numpy: "torch.Tensor.numpy",
}
# Tensors made from Python data on a named device: on CUDA a copy from pageable host memory.
_HOST_DATA_FACTORIES = {
    torch.tensor: "torch.tensor",
    torch.as_tensor: "torch.as_tensor",
    torch.asarray: "torch.asarray",
}
# Moves to a named device: on CUDA a host-to-device copy whenever the source is a host tensor.
# On the CPU emulator every tensor is a host tensor on the graph's device, so any such move in a
# segment is caught, where the same line on a GPU fails for a host source.
_DEVICE_MOVES = {
    torch.Tensor.to: "torch.Tensor.to",
    torch.Tensor.cuda: "torch.Tensor.cuda",
}


def _named_device(args: tuple, kwargs: dict) -> Optional[torch.device]:
    if kwargs.get("device") is not None:
        return torch.device(kwargs["device"])
    for a in args:
        if isinstance(a, torch.device) or isinstance(a, str):
            return torch.device(a)
        if isinstance(a, int) and not isinstance(a, bool):
            return torch.device("cuda", a)
    return None


def host_to_device_reason(func, args: tuple, kwargs: dict, device: torch.device) -> Optional[str]:
    """Why a torch-level call inside a segment of a graph on `device` would copy host data to
    that device, or None: a tensor from Python data made on it, or a host tensor moved to it
    (pinned host tensors are fine: CUDA captures those copies)."""
    if func in _HOST_DATA_FACTORIES:
        target = kwargs.get("device")
        return HOST_TO_DEVICE if target is not None and torch.device(target).type == device.type else None
    if func in _DEVICE_MOVES:
        src = args[0] if args else None
        if not isinstance(src, torch.Tensor) or src.device.type != "cpu" or src.is_pinned():
            return None
        target = torch.device("cuda") if func is torch.Tensor.cuda else _named_device(args[1:], kwargs)
        return HOST_TO_DEVICE if target is not None and target.type == device.type else None
    return None


def capture_error(op_name: str, reason: str) -> GraphCaptureError:
    return GraphCaptureError(
        f"{op_name} inside a breakable-graph segment: {reason}; "
        "move it out of the segment or into a break op"
    )


def _argument(func, args: tuple, kwargs: dict, name: str) -> Any:
    if name in kwargs:
        return kwargs[name]
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == name:
            return args[i] if i < len(args) else arg.default_value
    return None


def forbidden_reason(func, args: tuple, kwargs: dict) -> Optional[str]:
    """Why `func(*args, **kwargs)` cannot run inside a captured segment, or None."""
    schema_name = func._schema.name
    reason = _FORBIDDEN_OPS.get(schema_name)
    if reason is not None:
        return reason
    if schema_name == "aten::repeat_interleave":
        has_tensor_repeats = isinstance(_argument(func, args, kwargs, "repeats"), torch.Tensor)
        if has_tensor_repeats and _argument(func, args, kwargs, "output_size") is None:
            return DATA_DEPENDENT_SHAPE + "; pass output_size="
    if schema_name in _MASK_INDEXING_OPS:
        indices = _argument(func, args, kwargs, "indices") or ()
        if any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices
        ):
            return DATA_DEPENDENT_SHAPE + " from boolean-mask indexing; use torch.where/masked_fill"
    return None


class SegmentDispatchGuard(TorchDispatchMode):
    """Raises GraphCaptureError for forbidden aten ops dispatched inside a segment.

    Subclasses observe the allowed ops through `_run` (the emulator records them there).
    """

    def __init__(self, graph: "BreakableGraph"):
        super().__init__()
        self._graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # A split op reached through the dispatcher splits the graph in its own kernel,
        # unless break ops are inline (a full graph): then it is an ordinary recorded op.
        if self._graph.in_break_op or (is_split_op(func) and not break_ops_are_inline()):
            return func(*args, **kwargs)
        reason = forbidden_reason(func, args, kwargs)
        if reason is not None:
            raise capture_error(str(func), reason)
        return self._run(func, args, kwargs)

    def _run(self, func, args: tuple, kwargs: dict) -> Any:
        return func(*args, **kwargs)


class SegmentHostReadGuard(TorchFunctionMode):
    """Catches host reads that never reach the dispatcher on CPU (`tolist`, `numpy`), and
    host-to-device copies (tensors from Python data on a named device, `.to(device)` /
    `.cuda()` of unpinned tensors), which a CPU run performs as no-op copies."""

    def __init__(self, graph: "BreakableGraph"):
        super().__init__()
        self._graph = graph

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._graph.in_break_op:
            name = _HOST_READ_METHODS.get(func)
            if name is not None:
                raise capture_error(name, HOST_SYNC)
            reason = host_to_device_reason(func, args, kwargs, self._graph.device)
            if reason is not None:
                raise capture_error(_HOST_DATA_FACTORIES.get(func) or _DEVICE_MOVES[func], reason)
        return func(*args, **kwargs)
