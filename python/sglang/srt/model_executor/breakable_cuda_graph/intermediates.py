"""Break arguments that are intermediates: held by the record without keeping them allocated.

A break op's record must name its tensor arguments for every replay. Held strongly, each
layer's attention input and output (q, o, the indexer's q and weights) stay allocated for
the graph's life, so a graph's pool grows with the number of layers: about 0.6 GiB per
layer for a 4096-token bucket at DeepSeek-V4-Flash dims, 26 GiB for 43 layers.

Those tensors are intermediates: a segment writes them, the break reads or writes them and
the next segment reads them, all in one replay, in the order they were captured. A split op
declares such arguments `transient`. Under capture the record keeps a non-owning alias of
each (same address, dtype, shape, strides), so when the model drops its own reference the
block goes back to the graph pool and a later layer, or a later bucket's capture, reuses it,
exactly as it reuses any other intermediate freed during capture. A replay writes each block
before it reads it, as the capture did. This relies on the rule every shared graph pool
already relies on: graphs sharing a pool replay one at a time, never concurrently.

A transient argument must have been allocated by the capture, into the graph pool: anything
else (a persistent buffer, a tensor made eagerly) could be freed and reused by eager work
while the record still points at it. Capture checks that and refuses otherwise.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch

from sglang.srt.model_executor.breakable_cuda_graph.errors import GraphCaptureError

# pool handle -> [(address, size)] of the pool's allocator segments, refreshed on a miss
_pool_segments: dict[tuple, list[tuple[int, int]]] = {}
_signatures: dict[Callable, inspect.Signature] = {}


def weak_alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor on `t`'s memory (same dtype, offset, shape, strides) that does not own it."""
    storage = t.untyped_storage()
    borrowed = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), t.device, storage.nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(borrowed, t.storage_offset(), t.size(), t.stride())


def _in(segments: list[tuple[int, int]], ptr: int) -> bool:
    return any(start <= ptr < start + size for start, size in segments)


def pool_segments(pool: tuple) -> list[tuple[int, int]]:
    """(address, size) of every allocator segment the graph pool `pool` holds now."""
    _pool_segments[pool] = [(s["address"], s["total_size"]) for s in torch.cuda.memory._snapshot()["segments"]
                            if tuple(s["segment_pool_id"]) == tuple(pool)]
    return _pool_segments[pool]


def pool_reserved_bytes(pool: tuple) -> int:
    """Device memory the graph pool holds: what its graphs keep, not the allocator's cache."""
    return sum(size for _, size in pool_segments(pool))


def allocated_in_pool(t: torch.Tensor, pool: tuple) -> bool:
    """True when `t`'s memory lies in one of the graph pool's allocator segments."""
    ptr = t.untyped_storage().data_ptr()
    # On a miss the pool may have grown since the last look: read the allocator's segments.
    return _in(_pool_segments.get(pool, []), ptr) or _in(pool_segments(pool), ptr)


def hold_break_arguments(op_name: str, fn: Callable, transient: frozenset, args: tuple, kwargs: dict,
                         pool: tuple) -> tuple[tuple, dict]:
    """`args`/`kwargs` with every tensor named in `transient` replaced by a weak alias, after
    checking it lives in `pool` (GraphCaptureError naming the argument if not)."""
    if not transient:
        return args, kwargs
    if fn not in _signatures:
        _signatures[fn] = inspect.signature(fn)
    bound = _signatures[fn].bind(*args, **kwargs)
    for name in transient:
        t = bound.arguments.get(name)
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            continue  # None (e.g. no indexer on this layer) or nothing to free
        if not allocated_in_pool(t, pool):
            raise GraphCaptureError(
                f"break op '{op_name}': argument '{name}' is declared transient, but its memory was not "
                "allocated by this capture (it is not in the graph pool). Transient arguments must be "
                "intermediates the captured segments produce; drop it from the op's transient list")
        bound.arguments[name] = weak_alias(t)
    return bound.args, bound.kwargs
