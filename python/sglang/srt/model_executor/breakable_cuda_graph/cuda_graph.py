"""Breakable CUDA graph on a GPU: one torch.cuda.CUDAGraph per segment, all segments of all
graphs in one memory pool, captured on a dedicated stream, break ops eager in between.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator, Optional

import torch

from sglang.srt.model_executor.breakable_cuda_graph.base import BreakableGraph
from sglang.srt.model_executor.breakable_cuda_graph.errors import GraphCaptureError
from sglang.srt.model_executor.breakable_cuda_graph.intermediates import hold_break_arguments
from sglang.srt.model_executor.breakable_cuda_graph.guard import (
    SegmentDispatchGuard,
    SegmentHostReadGuard,
)

_EMPTY_GRAPH_WARNING = "The CUDA Graph is empty"
# CUDA errors from a host sync during capture say "operation not permitted when stream is
# capturing" / "operation failed due to a previous error during capture".
_CAPTURE_ERROR_HINT = "captur"

_pools: dict[int, tuple] = {}
_pool_keepers: list[torch.cuda.CUDAGraph] = []
_retired_pools: set[tuple] = set()
_capture_streams: dict[int, torch.cuda.Stream] = {}


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def graph_memory_pool(device: torch.device | str) -> Optional[tuple]:
    """The memory pool shared by every breakable graph on `device` (None off CUDA).

    One pool for all buckets: a runner captures largest bucket first, and smaller buckets
    reuse its blocks instead of each bucket reserving its own activations.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return None
    index = _device_index(device)
    if index not in _pools:
        with torch.cuda.device(index):
            handle = torch.cuda.graph_pool_handle()
            _pool_keepers.append(_keep_pool_alive(handle, index))
            _pools[index] = handle
    return _pools[index]


def _retire_pool(index: int, handle: tuple) -> None:
    """Stop handing out `handle` after a capture into it failed.

    torch 2.11 raises from capture_end before the pinned-host allocator stops recording
    into the pool, so every later capture into it fails ("already recording to
    mempool_id"). Graphs already captured there keep working; new ones get a fresh pool.
    """
    _retired_pools.add(handle)
    if _pools.get(index) == handle:
        del _pools[index]


def _keep_pool_alive(handle: tuple, index: int) -> torch.cuda.CUDAGraph:
    """An empty graph captured into the pool and never released.

    The allocators (the device one and, since torch 2.11, the pinned-host one) retire a
    graph pool when the last graph using it is released, and a later capture into the
    retired handle fails an internal assert. With this graph alive, the shared pool
    outlives release() of every real graph, so a runner can recapture its buckets.
    """
    keeper = torch.cuda.CUDAGraph()
    with torch.cuda.stream(_capture_stream(index)), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_EMPTY_GRAPH_WARNING)
        keeper.capture_begin(pool=handle)
        keeper.capture_end()
    return keeper


def _capture_stream(index: int) -> torch.cuda.Stream:
    # Capturing on the legacy default stream is not allowed; one side stream per device.
    if index not in _capture_streams:
        _capture_streams[index] = torch.cuda.Stream(device=index)
    return _capture_streams[index]


class CudaBreakableGraph(BreakableGraph):
    """`pool`: a handle from graph_memory_pool() (the default). A bare
    torch.cuda.graph_pool_handle() also works, but stops being usable for new captures once
    every graph captured into it has been released. A pool retired after a failed capture
    is replaced by the device's current shared pool."""

    def __init__(
        self, device: torch.device | str, *, pool: Optional[tuple] = None, debug: bool = False
    ):
        device = torch.device(device)
        super().__init__(torch.device("cuda", _device_index(device)), debug=debug)
        if pool is None or pool in _retired_pools:
            pool = graph_memory_pool(self.device)
        self.pool = pool
        self._graphs: list[torch.cuda.CUDAGraph] = []
        # A segment with no kernels (break first, last, or two breaks in a row) is not
        # replayed: launching an empty graph is at best a wasted call.
        self._segment_is_empty: list[bool] = []

    @contextlib.contextmanager
    def _capture_context(self) -> Iterator[None]:
        # As torch.cuda.graph does: eager work queued before capture (warm-up, input
        # copies) must be finished, or it could race with the capture's first kernels.
        torch.cuda.synchronize(self.device)
        stream = _capture_stream(self.device.index)
        caller_stream = torch.cuda.current_stream(self.device)
        stream.wait_stream(caller_stream)
        try:
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                with contextlib.ExitStack() as guards:
                    if self.debug:
                        # Names the offending op before CUDA fails with a generic error.
                        guards.enter_context(SegmentHostReadGuard(self))
                        guards.enter_context(SegmentDispatchGuard(self))
                    yield
        finally:
            caller_stream.wait_stream(stream)

    def _begin_segment(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool)
        self._graphs.append(graph)

    def _end_segment(self) -> None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self._graphs[-1].capture_end()
        empty = False
        for warning in caught:
            if _EMPTY_GRAPH_WARNING in str(warning.message):
                empty = True  # expected for a break at the start/end; not worth a warning
            else:
                warnings.warn_explicit(
                    warning.message, warning.category, warning.filename, warning.lineno
                )
        self._segment_is_empty.append(empty)

    def _abort_segment(self) -> None:
        graph = self._graphs.pop()
        try:
            graph.capture_end()
            return
        except Exception:  # the capture was invalidated (e.g. by a host sync)
            pass
        end_allocate_to_pool = getattr(torch._C, "_cuda_endAllocateToPool", None)
        if end_allocate_to_pool is not None:
            try:  # torch 2.11's capture_end raised before ending the device pool routing
                end_allocate_to_pool(self.device.index, self.pool)
            except Exception:
                pass
        _retire_pool(self.device.index, self.pool)

    def _hold_arguments(self, name, fn, transient, args, kwargs):
        # Transient arguments (per-layer q, o, ...) go back to the pool once the model drops
        # them, so the pool holds about one layer's activations, not one per layer.
        return hold_break_arguments(name, fn, transient, args, kwargs, self.pool)

    def _translate_capture_error(self, error: BaseException) -> BaseException:
        if isinstance(error, GraphCaptureError) or not isinstance(error, RuntimeError):
            return error
        if _CAPTURE_ERROR_HINT not in str(error).lower():
            return error
        return GraphCaptureError(
            f"CUDA stream capture failed inside breakable-graph segment {len(self._breaks)}: "
            "most likely a host sync or data-dependent output shape (.item(), bool(tensor), "
            ".tolist(), nonzero, masked_select, boolean-mask indexing, ...); move it out of "
            "the segment or into a break op. Capture with debug=True (--debug-cuda-graph) to "
            f"name the op. CUDA error: {error}"
        )

    def _replay_segment(self, index: int) -> None:
        if not self._segment_is_empty[index]:
            self._graphs[index].replay()

    def _release_segments(self) -> None:
        for graph in self._graphs:
            graph.reset()
        self._graphs = []
        self._segment_is_empty = []
