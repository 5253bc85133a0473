"""The live batch of the forward pass in flight, for break ops that run eagerly between
graph segments (they cannot take the batch as an argument: their arguments are frozen at
capture)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Optional


@dataclass
class ForwardContext:
    forward_batch: Any
    attn_backend: Any
    num_live_tokens: int
    dp_moe: Any = None  # DPMoEContext when DP attention gathers around the MoE


_current: Optional[ForwardContext] = None


@contextlib.contextmanager
def forward_context(forward_batch, attn_backend, num_live_tokens: Optional[int] = None, dp_moe=None):
    global _current
    prev = _current
    n = forward_batch.num_live_tokens if num_live_tokens is None else num_live_tokens
    _current = ForwardContext(forward_batch, attn_backend, n, dp_moe)
    try:
        yield _current
    finally:
        _current = prev


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("no forward pass in flight: attention ran outside forward_context()")
    return _current


def segment_kernel_ops():
    """sgl-kernel's dsv4_kernels.ops when the forward pass in flight runs segment kernels (its
    attention backend's `segment_kernels`), else None: also outside any forward pass, where
    layers used on their own keep their torch code."""
    if _current is None or not getattr(_current.attn_backend, "segment_kernels", False):
        return None
    from dsv4_kernels import ops  # imported on first use: CPU-only installs never need triton

    return ops
