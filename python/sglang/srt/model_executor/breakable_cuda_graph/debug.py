"""Debug checks (--debug-cuda-graph): did a break op's tensor argument move since capture?

Segments read and write the storage a break argument had at capture. If someone later
calls `.set_()`, `.resize_()` or assigns `.data` on it, the break op would read or write
other memory than the segments: a silent wrong answer that this turns into an error.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from sglang.srt.model_executor.breakable_cuda_graph.errors import BreakableGraphStaleError


@dataclass(frozen=True)
class TensorArgSnapshot:
    label: str  # parameter name, e.g. "output" or "kv_caches[2]"; "#0" when unnamed
    tensor: torch.Tensor
    data_ptr: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def take(cls, label: str, tensor: torch.Tensor) -> "TensorArgSnapshot":
        return cls(
            label,
            tensor,
            tensor.data_ptr(),
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.dtype,
            tensor.device,
        )

    def changes(self) -> list[str]:
        now = TensorArgSnapshot.take(self.label, self.tensor)
        found = []
        if now.data_ptr != self.data_ptr:
            found.append(f"storage moved {self.data_ptr:#x} -> {now.data_ptr:#x}")
        for what in ("shape", "stride", "dtype", "device"):
            before, after = getattr(self, what), getattr(now, what)
            if before != after:
                found.append(f"{what} changed {_fmt(before)} -> {_fmt(after)}")
        return found


def _fmt(value: Any) -> str:
    return str(tuple(value)) if isinstance(value, tuple) else str(value)


def _tensors_in(label: str, value: Any) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield label, value
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _tensors_in(f"{label}[{i}]", item)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors_in(f"{label}[{key!r}]", item)


def _labelled_arguments(fn: Callable, args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
        return list(bound.arguments.items())
    except (TypeError, ValueError):
        # No usable signature (builtins, C extensions): fall back to positions.
        return [(f"#{i}", a) for i, a in enumerate(args)] + list(kwargs.items())


def snapshot_break_arguments(fn: Callable, args: tuple, kwargs: dict) -> list[TensorArgSnapshot]:
    """Storage/shape/stride/dtype/device of every tensor argument, including inside lists."""
    return [
        TensorArgSnapshot.take(label, tensor)
        for name, value in _labelled_arguments(fn, args, kwargs)
        for label, tensor in _tensors_in(name, value)
    ]


def check_break_arguments(index: int, name: str, snapshots: list[TensorArgSnapshot]) -> None:
    """Raise BreakableGraphStaleError naming the first argument that moved."""
    for snap in snapshots:
        changes = snap.changes()
        if changes:
            raise BreakableGraphStaleError(
                f"break {index} '{name}' argument '{snap.label}': " + "; ".join(changes)
            )
