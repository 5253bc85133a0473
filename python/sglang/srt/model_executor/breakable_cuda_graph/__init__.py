"""Breakable CUDA graphs: a forward captured as graph segments split at eager break ops.

`create_breakable_graph(device)` picks real CUDA graphs on a GPU and the CPU emulator
elsewhere; both follow docs/design.md, contracts 1, 2 and 7.
"""

from __future__ import annotations

from typing import Optional

import torch

from sglang.srt.model_executor.breakable_cuda_graph.base import BreakableGraph, BreakRecord
from sglang.srt.model_executor.breakable_cuda_graph.break_op import (
    break_ops_inline,
    current_graph,
    eager_on_graph,
    get_split_ops,
    is_capturing,
    register_split_op,
)
from sglang.srt.model_executor.breakable_cuda_graph.cuda_graph import (
    CudaBreakableGraph,
    graph_memory_pool,
)
from sglang.srt.model_executor.breakable_cuda_graph.emulator import EmulatedBreakableGraph
from sglang.srt.model_executor.breakable_cuda_graph.errors import (
    BreakableGraphStaleError,
    GraphCaptureError,
)


def create_breakable_graph(
    device: torch.device | str, *, pool: Optional[tuple] = None, debug: bool = False
) -> BreakableGraph:
    """A CudaBreakableGraph on CUDA devices (sharing `pool`, default the device's shared
    pool), an EmulatedBreakableGraph anywhere else (`pool` is ignored there)."""
    device = torch.device(device)
    if device.type == "cuda":
        return CudaBreakableGraph(device, pool=pool, debug=debug)
    return EmulatedBreakableGraph(device, debug=debug)


__all__ = [
    "BreakRecord",
    "break_ops_inline",
    "BreakableGraph",
    "BreakableGraphStaleError",
    "CudaBreakableGraph",
    "EmulatedBreakableGraph",
    "GraphCaptureError",
    "create_breakable_graph",
    "current_graph",
    "eager_on_graph",
    "get_split_ops",
    "graph_memory_pool",
    "is_capturing",
    "register_split_op",
]
